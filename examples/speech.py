"""Text to speech (/v1/audio/speech), streamed to a file as it is made.

    OPENAI_API_KEY=sk-local python examples/speech.py "Hello there" --out hello.wav
"""

from __future__ import annotations

from _common import client, model, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("text")
    p.add_argument("--voice", default="alloy")
    p.add_argument("--format", default="wav", help="wav, pcm, mp3, flac, opus or aac")
    p.add_argument("--out", default="speech.wav")
    args = p.parse_args()
    c = client()
    with c.audio.speech.with_streaming_response.create(
            model=model(c, args.model), input=args.text, voice=args.voice,
            response_format=args.format) as resp:
        resp.stream_to_file(args.out)
    print(f"speech: {args.out}")


if __name__ == "__main__":
    main()
