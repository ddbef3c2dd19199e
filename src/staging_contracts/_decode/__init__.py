"""The decode side of the staging path: one handler per decode rank.

:mod:`.handler` (:class:`~.handler.DecodeStagingHandler`: ring regions for ``STAGING_REQ``,
arrivals, room lifecycle), :mod:`.rooms` (plain records of rooms and their chunk regions),
:mod:`.scatter` (a landed region into the paged KV pool) and :mod:`.publisher` (``STAGING_RSP``
and ``WATERMARK`` to the prefill peers).

May import: ``_staging``, ``_control``, ``outcomes``, ``protocols``, ``stats``; never ``_prefill``.
Imported by: ``backends``, ``_bench``, ``testing``.
"""
