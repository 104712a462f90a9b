"""``dyncompile run PLAN --prompt TEXT --seed N -o OUT.png`` for text-to-image plans."""

from __future__ import annotations

import json
from pathlib import Path

from dyncompile.errors import DataError, OutputExistsError


def _check_outputs(paths: list[Path], force: bool) -> None:
    """Refuse to write over an existing file without ``--force``, and over anything but a regular file at all."""
    for path in paths:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise OutputExistsError(f"-o: {path} exists and is not a regular file; choose another -o")
        if path.exists() and not force:
            raise OutputExistsError(f"-o: {path} already exists; pass --force to replace it, or choose another -o")


def run_text_to_image(model, args) -> int:
    from dyncompile.runtime.diffusion.png import save_png
    from dyncompile.tools._text import safe_text

    prompts = ([args.prompt] if args.prompt is not None else []) + list(args.text or [])
    if not prompts:
        raise DataError("give --prompt TEXT for a text-to-image plan (and -o OUT.png)")
    if not args.output:
        raise DataError("give -o OUT.png: where to write the generated image")
    out = Path(args.output)
    if out.suffix.lower() != ".png":
        raise DataError(f"-o {out}: the output must be a .png file")
    if not out.parent.is_dir():
        raise DataError(f"-o {out}: folder {out.parent} does not exist")
    paths = [out] if len(prompts) == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(len(prompts))]
    force = bool(getattr(args, "force", False))
    _check_outputs(paths, force)  # before any work
    res = model.generate_images(prompts, seed=0 if args.seed is None else args.seed, steps=args.steps,
                          guidance=args.guidance, policy=args.policy, cache_interval=getattr(args, "cache_interval", None))
    _check_outputs(paths, force)  # again: a file may have appeared while the images were made
    for path, img in zip(paths, res.images):
        save_png(path, img, replace=force)
    if args.json:
        print(json.dumps({**res.to_dict(), "files": [str(p) for p in paths]}, indent=2))
    else:
        for path, prompt, k in zip(paths, prompts, res.steps):
            print(f"{safe_text(path)}  ({int(k)} steps, policy {res.policy})  | {safe_text(prompt, keep_newlines=False)}")
        shallow = f" ({res.shallow_calls} on the cached features)" if res.shallow_calls else ""
        print(f"{len(prompts)} image(s) in {res.seconds:.2f} s, {res.unet_calls} U-Net calls{shallow}")
    return 0

