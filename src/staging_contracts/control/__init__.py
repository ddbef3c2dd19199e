"""The control plane: typed codecs of the four staging messages, and ZMQ peer sockets.

:mod:`.wire` encodes and decodes ``STAGING_REQ``, ``STAGING_RSP``, ``WATERMARK`` and
``CHUNK_READY`` (anything else raises :class:`~.wire.MalformedMessage`); :mod:`.transport`
holds the non-blocking peer sockets and the listener thread that decodes and dispatches.

May import: ``protocols`` and ``stats`` only.
Imported by: ``decode``, ``prefill``, ``mixin``, ``backends``, ``bench``, ``testing``.
"""
