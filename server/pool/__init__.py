"""The worker processes and the pool that drives them: what a worker runs (opening datasets,
building batches into shared memory), what pool and worker say over a pipe, and the pool the
front end owns. Nothing here imports the front end.
"""
