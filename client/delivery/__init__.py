"""What happens to a batch once its bytes are here: the host and pinned buffers it lands in
(buffers.py), its copy to the device (device.py), uint8 images normalised (normalize.py), a
mixture's samples counted by component (sources.py).

Threads: receive threads allocate buffers, start device copies and count sources as a batch
completes; the loop's thread hands a batch over, releases its buffers and reads the counts.
Each class names the lock that guards it.
Imports: the client's leaves and transport's assembled batch (a value); nothing of the fleet,
contact or the loader.
"""
