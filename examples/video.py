"""Text to video (/v1/videos): create a job, wait for it (the SDK polls its status and
progress), download the MP4.

    omnistage serve tiny:wan --api-key sk-local
    OPENAI_API_KEY=sk-local python examples/video.py "a wave breaking" --out wave.mp4
"""

from __future__ import annotations

from pathlib import Path

from _common import client, model, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("prompt")
    p.add_argument("--size", default="480x320")
    p.add_argument("--seconds", default="1")
    p.add_argument("--steps", type=int)
    p.add_argument("--out", default="video.mp4")
    args = p.parse_args()
    c = client()
    extra = {} if args.steps is None else {"num_inference_steps": args.steps}
    job = c.videos.create_and_poll(model=model(c, args.model), prompt=args.prompt, size=args.size,
                                   seconds=args.seconds, extra_body=extra, poll_interval_ms=200)
    if job.status != "completed":
        raise SystemExit(f"video job {job.id} {job.status}: {job.error}")
    c.videos.download_content(job.id).write_to_file(args.out)
    print(f"video: {args.out} ({Path(args.out).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
