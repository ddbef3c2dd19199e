"""The multi-process runner: a staged transfer across real processes, and the demo.

:mod:`.runner` (:func:`~.runner.run_cluster`: spawn the ranks, follow them, gather reports),
:mod:`.rank` (one prefill or decode rank as an OS process), :mod:`.plain_paths` (the anchor
paths the ranks also run), :mod:`.bootstrap` (where ranks meet), :mod:`.preflight` (a run
refused before any process starts) and :mod:`.demo` (``staging-contracts demo``).

The soak (``staging-contracts soak``): :mod:`.soak` (:func:`~.soak.run_soak`: rank processes
kept busy with rooms while faults are injected), :mod:`.soak_rank` (a long-running rank that
serves rooms on command) and :mod:`.soak_report` (its faults, configuration, result and
summary), :mod:`.soak_ticker` (its progress tally, at least every 10 s).

What an operator reads: :mod:`.summary_json` (the ``--json`` documents of ``check``, ``demo``
and ``soak``) and :mod:`.logformat` (every process's log lines: timestamped text, or JSON).

May import: ``_run``, ``backends`` and everything below them; never ``testing``, ``_bench`` or
``cli``.
Imported by: ``_bench`` and ``cli``.
"""
