"""What the server, GPUs and network were doing: scraped, normalised to one vocabulary, aligned to the run."""
