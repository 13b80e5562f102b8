"""Media inputs: decoding audio, images and video from request bytes into arrays."""
