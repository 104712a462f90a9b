"""``dyncompile run PLAN --prompt TEXT --seed N -o OUT.png`` for text-to-image plans."""

from __future__ import annotations

import json
from pathlib import Path

from dyncompile.errors import DataError


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
    res = model.generate_images(prompts, seed=0 if args.seed is None else args.seed, steps=args.steps,
                          guidance=args.guidance, policy=args.policy)
    paths = [out] if len(prompts) == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(len(prompts))]
    for path, img in zip(paths, res.images):
        save_png(path, img)
    if args.json:
        print(json.dumps({**res.to_dict(), "files": [str(p) for p in paths]}, indent=2))
    else:
        for path, prompt, k in zip(paths, prompts, res.steps):
            print(f"{safe_text(path)}  ({int(k)} steps, policy {res.policy})  | {safe_text(prompt, keep_newlines=False)}")
        print(f"{len(prompts)} image(s) in {res.seconds:.2f} s, {res.unet_calls} U-Net calls")
    return 0

