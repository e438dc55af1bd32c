"""flexfa's tests. A package so that every test directory can share `tests.mods` (the catalog of
score_mods and mask_mods) and `tests.tolerance` (the three-way error rule)."""
