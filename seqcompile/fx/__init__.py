"""The FX helpers every stage shares, at the ground floor (they import nothing of seqcompile
above them): `nodes` (reading and inserting nodes, their values, source locations and grad-mode
barriers), `aliasing` (which ops write in place or through a view) and `evaluate` (a value of the
graph computed on concrete tensors, to check a reading against the model's own code)."""
