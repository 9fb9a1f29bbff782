"""Unit lane: pure functions, no subprocess, server, socket, Ray or CLI (./scripts/test --fast)."""
