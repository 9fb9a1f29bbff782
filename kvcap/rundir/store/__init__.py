"""The out-of-core column store: a run's records and telemetry as numpy columns, in bounded memory whatever the
run's length.

``columns`` turns a chunk of request records into per-level columns (``extract``, ``LevelArrays``) and grows a
level's columns as chunks arrive (``Builder``); ``column_reader`` streams ``requests.jsonl`` (or its binary copy)
into them; ``column_file`` writes and reads the binary copies ``sim`` leaves beside ``requests.jsonl`` and
``telemetry.jsonl`` (trusted only while those files are the ones they were written beside); ``record_columns``
takes that copy from the records in hand; ``tokens`` counts tokens inside a window; ``quantiles`` keeps a level's
ITLs and gives exact percentiles from values or counts.

The block protocol: a ``Builder`` with a ``Spill`` hands it every ``BLOCK_ROWS`` rows (counted exactly, so no
figure depends on how a file was chunked) as one block — a dict of named arrays, the per-window token counts
included — and keeps the handle ``Spill.put`` returns. ``level_blocks.Level`` holds those handles and the rows
left in memory, and gives the level back a block at a time (``Level.blocks``), so a reader holds one block.
"""
