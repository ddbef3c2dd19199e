"""The prefill side of the staging path: the staging writer and its books.

:mod:`.writer` (:class:`~.writer.StagingWriter`: request a region, wait for the watermark,
gather, write with the engine, signal arrival) and :mod:`.books` (what decode announced:
watermarks and region answers, read by the transfer workers).

May import: ``_staging``, ``_control``, ``protocols``, ``stats``; never ``_decode``.
Imported by: ``backends``, ``_cluster``, ``_bench``, ``testing``.
"""
