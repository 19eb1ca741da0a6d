"""The code the native generator's parts contribute, as plain Python: each file importable under the npu stand-in
with a cann-recipes-infer checkout on sys.path, assembled into one modeling file by agent.recipe.native.assemble
(the `Model` prefix renamed to the family's, roles bound to the composition's classes, options folded)."""
