// Spin kernels for tests and benchmarks: each thread busy-waits for a number of SM clock
// cycles, holding the stream (and, with one block per SM, the GPU) for a known time.

// Spins every thread of the grid for cycles SM clock cycles (none when cycles <= 0).
extern "C" __global__ void dl_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
