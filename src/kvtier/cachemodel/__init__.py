"""The project's one cache model: trace reading, reuse distances, the ceilings (infinite cache,
offline optimum) and predictions made by driving the real tier classes as the engine does.

`kvtier plan` and `kvtier bench` import it; no module below the tools does.
"""
