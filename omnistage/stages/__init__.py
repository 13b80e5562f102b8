"""Stages: the units a model's recipe wires into a graph (encoders, AR engines, vocoders)."""
