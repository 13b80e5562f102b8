"""Image editing (/v1/images/edits): one or more input images and an instruction, the result
written as PNG.

    omnistage serve tiny:qwen_image_edit_plus --api-key sk-local
    OPENAI_API_KEY=sk-local python examples/image_edit.py photo.png "make the sky green" --out edited.png
"""

from __future__ import annotations

import base64
from contextlib import ExitStack
from pathlib import Path

from _common import client, model, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("images", nargs="+", help="input image file(s), then the instruction")
    p.add_argument("--size", default="auto")
    p.add_argument("--steps", type=int)
    p.add_argument("--out", default="edited.png")
    args = p.parse_args()
    *files, instruction = args.images
    if not files:
        p.error("give at least one image file before the instruction")
    c = client()
    extra = {} if args.steps is None else {"num_inference_steps": args.steps}
    with ExitStack() as stack:
        images = [stack.enter_context(open(f, "rb")) for f in files]
        resp = c.images.edit(model=model(c, args.model), image=images if len(images) > 1 else images[0],
                             prompt=instruction, size=args.size, extra_body=extra)
    Path(args.out).write_bytes(base64.b64decode(resp.data[0].b64_json))
    print(f"image: {args.out}")


if __name__ == "__main__":
    main()
