"""Output for people: terminal tables (rich), HTML and Markdown reports, JSON."""
