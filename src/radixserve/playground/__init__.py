"""`radixserve playground`: a web page over the simulator (the real scheduler and radix cache)
and a live view of a running fleet."""
