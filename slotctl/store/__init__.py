"""Slot files in an object store (``s3://``), docs/store.md.

- ``config``: the endpoint and credentials (the environment and the AWS files), ``s3://`` URLs;
- ``s3``: reading and writing objects through obstore; importing it registers the ``s3`` scheme with
  :mod:`slotctl.sources`, so every command that reads a slot file reads an object as well;
- ``s3copy``: server-side copies (``UploadPartCopy``), signed here: cp across buckets, strip-draft in place;
- ``cp``: ``slotctl cp`` between local paths and objects;
- ``strip``: strip-draft of an object (a server-side copy of its prefix);
- ``convert``: convert of a file or of every slot file of a directory or prefix, objects downloaded and
  uploaded around :mod:`slotctl.convert`'s rewrite (``s3`` imported only for an ``s3://`` path).

Imports point down: ``cp``, ``strip`` and ``convert`` over ``s3``, over ``s3copy``, over ``config``. Nothing here imports
llama.cpp, the CLI, the live server or the fleet. Importing this package imports none of its modules (and
not obstore): the CLI imports ``s3`` only when an ``s3://`` path is given.
"""
