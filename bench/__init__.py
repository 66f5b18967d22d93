"""Benchmark harness: closed-loop load over the public API, transformers' generate() as the peer, and
stage micro-benchmarks, all writing the same result schema (see bench/README.md)."""
