"""Text-to-image plans: the diffusion step handlers, the guided denoising loop and PNG writing."""
