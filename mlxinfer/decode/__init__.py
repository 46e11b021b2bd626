"""Logits to tokens: sampling (`sample`), the token sources every decoder yields the same `Token`
from (`sources`: plain, constrained, a scored prompt), and speculative decoding (`speculative`)."""
