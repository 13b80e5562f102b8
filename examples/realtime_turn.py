"""One spoken turn over the Realtime WebSocket (/v1/realtime): a WAV file streamed in as
pcm16 at 24 kHz in 100 ms appends, committed, and the answer's transcript printed and its
speech written to a WAV as the deltas arrive. (With server VAD, the default turn detection,
the commit and response.create happen by themselves at the end of speech; this example turns
it off to control the turn.)

    OPENAI_API_KEY=sk-local python examples/realtime_turn.py question.wav --out answer.wav
"""

from __future__ import annotations

import base64
import sys
import wave

import numpy as np

from _common import client, model, parser

RATE = 24000


def _pcm16(path: str) -> bytes:
    """The WAV's first channel as pcm16 at 24 kHz (linear resampling)."""
    import soundfile as sf

    audio, rate = sf.read(path, dtype="float32", always_2d=True)
    audio = audio[:, 0]
    if rate != RATE:
        t = np.arange(int(len(audio) * RATE / rate)) / RATE
        audio = np.interp(t, np.arange(len(audio)) / rate, audio)
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("audio", help="the spoken question, a WAV file")
    p.add_argument("--voice", default="alloy")
    p.add_argument("--out", default="answer.wav")
    args = p.parse_args()
    c = client()
    pcm = _pcm16(args.audio)
    with c.realtime.connect(model=model(c, args.model)) as conn, wave.open(args.out, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                     "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE},
                                                         "turn_detection": None},
                                               "output": {"voice": args.voice}}})
        step = RATE // 10 * 2                          # 100 ms of pcm16
        for i in range(0, len(pcm), step):
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())
        conn.input_audio_buffer.commit()
        conn.response.create()
        for event in conn:
            if event.type == "response.output_audio.delta":
                out.writeframes(base64.b64decode(event.delta))
            elif event.type == "response.output_audio_transcript.delta":
                sys.stdout.write(event.delta)
                sys.stdout.flush()
            elif event.type == "error":
                raise SystemExit(f"server error: {event.error.message}")
            elif event.type == "response.done":
                break
    print(f"\nspeech: {args.out}")


if __name__ == "__main__":
    main()
