"""A streamed chat answer: text deltas printed as they come, speech chunks (pcm16, 24 kHz)
appended to a WAV file as they come (play it while it grows, or pipe the chunks to a sound
card instead).

    OPENAI_API_KEY=sk-local python examples/stream_speech_to_wav.py "Tell me about the sea" --out sea.wav
"""

from __future__ import annotations

import base64
import sys
import wave

from _common import client, model, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("question")
    p.add_argument("--voice", default="alloy")
    p.add_argument("--out", default="answer.wav")
    args = p.parse_args()
    c = client()
    stream = c.chat.completions.create(
        model=model(c, args.model), messages=[{"role": "user", "content": args.question}], max_tokens=64,
        modalities=["text", "audio"], audio={"voice": args.voice, "format": "pcm16"}, stream=True)
    with wave.open(args.out, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24000)
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.content:
                sys.stdout.write(delta.content)
                sys.stdout.flush()
            audio = delta.audio
            if audio is not None and audio.data:
                out.writeframes(base64.b64decode(audio.data))
            if audio is not None and audio.transcript:
                sys.stdout.write(audio.transcript)
                sys.stdout.flush()
    print(f"\nspeech: {args.out}")


if __name__ == "__main__":
    main()
