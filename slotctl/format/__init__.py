"""construct schemas for every layer of a llama.cpp slot file. Pure: nothing here touches llama.cpp.

See docs/format.md for the byte layout and the modules below for each layer:
:mod:`.header` (state header), :mod:`.tokens` (token words), :mod:`.kv` and :mod:`.recurrent`
(memory sections), :mod:`.memory` (layouts of composite kinds), :mod:`.blob` (in-memory blobs),
:mod:`.appendix` (SCKP and SDFT), :mod:`.convert` (state versions 3 and 4).
"""

#: state versions slotctl understands: here, not in :mod:`.header`, so that the CLI's options read them
#: without construct
SUPPORTED_VERSIONS = (2, 3, 4)
