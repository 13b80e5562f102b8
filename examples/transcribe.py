"""Speech to text (/v1/audio/transcriptions) of an audio file.

    OPENAI_API_KEY=sk-local python examples/transcribe.py question.wav
"""

from __future__ import annotations

from pathlib import Path

from _common import client, model, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("audio", help="a WAV (or FLAC, MP3, OGG) file")
    args = p.parse_args()
    c = client()
    with Path(args.audio).open("rb") as f:
        text = c.audio.transcriptions.create(model=model(c, args.model), file=f, response_format="text")
    print(text)


if __name__ == "__main__":
    main()
