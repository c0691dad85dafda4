"""A simulated cluster on one CPU: Folio's real engine (scheduler, block manager,
migrations), worker, router and coordinator, with a runner that only keeps time.

    roofline.py  the step time of a named GPU and model (spec-sheet figures)
    runner.py    RooflineRunner: LLMEngine's runner with no tensors; simulated_engine()
    cluster.py   SimCluster: N simulated workers, real Redis, router and coordinator, no Ray
"""
