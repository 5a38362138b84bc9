"""The bridge itself: page out and page in (``bridge``), a pool's layout and
its blocks (``pool``), bounded host staging (``staging``), a model's
identity in a manifest (``identity``) and a reference-counting block
allocator (``allocator``)."""
