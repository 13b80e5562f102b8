"""Chat with audio in and audio out: a spoken question (a WAV file) and a text one, the answer
as text and as speech written to a WAV.

    omnistage serve tiny:qwen2_5_omni --api-key sk-local
    OPENAI_API_KEY=sk-local python examples/chat_audio.py --audio question.wav --out answer.wav
"""

from __future__ import annotations

import base64
from pathlib import Path

from _common import client, model, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--audio", help="a WAV file to ask with (default: a text question only)")
    p.add_argument("--text", default="Please answer briefly.")
    p.add_argument("--voice", default="alloy")
    p.add_argument("--out", default="answer.wav")
    args = p.parse_args()
    c = client()
    content = [{"type": "text", "text": args.text}]
    if args.audio:
        data = base64.b64encode(Path(args.audio).read_bytes()).decode()
        content.insert(0, {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
    resp = c.chat.completions.create(
        model=model(c, args.model), messages=[{"role": "user", "content": content}], max_tokens=64,
        modalities=["text", "audio"], audio={"voice": args.voice, "format": "wav"})
    msg = resp.choices[0].message
    Path(args.out).write_bytes(base64.b64decode(msg.audio.data))
    print(f"text: {msg.audio.transcript}")
    print(f"speech: {args.out}")


if __name__ == "__main__":
    main()
