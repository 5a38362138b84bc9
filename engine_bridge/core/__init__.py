"""The bridge itself: page out and page in (``bridge``), a pool's layout and
its blocks (``pool``), bounded host staging (``staging``) and a
reference-counting block allocator (``allocator``)."""
