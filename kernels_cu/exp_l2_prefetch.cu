// session 43 experiment (not part of the package): bulk L2 prefetch of up to two byte ranges, split over the grid's
// threads in 16 KB pieces; fire and forget (the kernel ends once the prefetches are issued)
extern "C" __global__ void exp_l2_prefetch(const unsigned char* p0, long long n0, const unsigned char* p1, long long n1) {
    const long long piece = 16384;
    const long long nthreads = (long long)gridDim.x * blockDim.x, tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long k0 = (n0 + piece - 1) / piece, k1 = (n1 + piece - 1) / piece;
    for (long long i = tid; i < k0 + k1; i += nthreads) {
        const unsigned char* p = i < k0 ? p0 + i * piece : p1 + (i - k0) * piece;
        const long long left = i < k0 ? n0 - i * piece : n1 - (i - k0) * piece;
        const unsigned sz = (unsigned)(left < piece ? left : piece) & ~15u;
        if (sz) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(sz) : "memory");
    }
}
