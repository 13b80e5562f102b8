"""Text to image (/v1/images/generations), written as PNG; `--partial-images N` streams
previews of the denoising as it goes.

    omnistage serve tiny:qwen_image --api-key sk-local
    OPENAI_API_KEY=sk-local python examples/image.py "a red cube on a table" --out cube.png
"""

from __future__ import annotations

import base64
from pathlib import Path

from _common import client, model, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("prompt")
    p.add_argument("--size", default="512x512")
    p.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    p.add_argument("--seed", type=int)
    p.add_argument("--partial-images", type=int, default=0, help="previews to stream (0-3)")
    p.add_argument("--out", default="image.png")
    args = p.parse_args()
    c = client()
    extra = {k: v for k, v in (("num_inference_steps", args.steps), ("seed", args.seed)) if v is not None}
    if args.partial_images:
        stream = c.images.generate(model=model(c, args.model), prompt=args.prompt, size=args.size,
                                   stream=True, partial_images=args.partial_images, extra_body=extra)
        for event in stream:
            if event.type == "image_generation.partial_image":
                preview = Path(args.out).with_suffix(f".partial{event.partial_image_index}.png")
                preview.write_bytes(base64.b64decode(event.b64_json))
                print(f"preview: {preview}")
            elif event.type == "image_generation.completed":
                Path(args.out).write_bytes(base64.b64decode(event.b64_json))
    else:
        resp = c.images.generate(model=model(c, args.model), prompt=args.prompt, size=args.size,
                                 extra_body=extra)
        Path(args.out).write_bytes(base64.b64decode(resp.data[0].b64_json))
    print(f"image: {args.out}")


if __name__ == "__main__":
    main()
