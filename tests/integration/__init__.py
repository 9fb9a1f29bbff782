"""Integration lane: the CLI in a subprocess, test servers, real peers (llama.cpp, Prometheus, Ray, chromium)."""
