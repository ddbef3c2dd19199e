"""The control plane: typed message codecs, ZMQ sockets, peer liveness, authentication.

:mod:`.wire` encodes and decodes ``STAGING_REQ``, ``STAGING_RSP``, ``WATERMARK`` and
``CHUNK_READY`` (anything else raises :class:`~.wire.MalformedMessage`); :mod:`.room_messages`
the per-request and peer messages (``ROOM_META``, ``ROOM_FAILED``,
``ROOM_FAILED_ACK``, ``ROOM_FENCE``, ``ROOM_FENCED``, ``PING``, ``PONG``); :mod:`.transport`
holds the non-blocking peer sockets and the listener thread that decodes and dispatches;
:mod:`.liveness` declares silent peers dead; :mod:`.security` the cluster secret, CURVE keys
and the ZAP handler.

May import: ``protocols`` and ``stats`` only.
Imported by: ``_decode``, ``_prefill``, ``mixin``, ``backends``, ``_bench``, ``testing``.
"""
