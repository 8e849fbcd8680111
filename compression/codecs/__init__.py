"""Built-in codecs; importing this package registers them (see compression.base.get_codec)."""
from compression.codecs import casts, chunktopk, dgc, lowbit, lowrank, quant, sign, sparse  # noqa: F401
