/* The reference for `ava bench collectives`: the same three collectives in plain MPI, on a
 * buffer of the same size, timed the same way (barrier, call; each call's time is its
 * slowest rank's; the median over the calls). What Ava's collectives trait adds on top of
 * MPI is the difference between the two tables.
 *
 *   mpicc -O2 -o /tmp/mpi_collectives tools/mpi_collectives.c
 *   mpirun -np 2 /tmp/mpi_collectives 64MiB
 *
 * SIZE accepts a plain byte count or a KiB/MiB/GiB suffix. Reduce-scatter here is MPI's own
 * MPI_Reduce_scatter; Ava's runs one MPI_Reduce per rank's range (rsmpi has no uneven
 * reduce-scatter), so comparing the two rows shows what that costs.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static long parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (!strcmp(end, "KiB")) v *= 1024.0;
    else if (!strcmp(end, "MiB")) v *= 1024.0 * 1024.0;
    else if (!strcmp(end, "GiB")) v *= 1024.0 * 1024.0 * 1024.0;
    return (long)v;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    long bytes = argc > 1 ? parse_size(argv[1]) : 64L << 20;
    int iters = argc > 2 ? atoi(argv[2]) : 20, warmup = 3;
    int elems = (int)(bytes / 4);
    bytes = 4L * elems;
    float *send = malloc(bytes), *recv = malloc(bytes);
    for (int i = 0; i < elems; i++) send[i] = 1.0f;
    int *counts = malloc(n * sizeof(int)), *displs = malloc(n * sizeof(int)), at = 0;
    for (int r = 0; r < n; r++) {
        counts[r] = elems / n + (r < elems % n);
        displs[r] = at;
        at += counts[r];
    }
    double *times = malloc(iters * sizeof(double)), factor = (double)(n - 1) / n;
    const char *names[3] = {"all-reduce", "reduce-scatter", "all-gather"};
    double bus[3] = {2.0 * factor, factor, factor};
    if (rank == 0) {
        printf("%d ranks over plain MPI, %ld bytes per call (%d f32)\n", n, bytes, elems);
        printf("%-16s%10s%14s%14s\n", "collective", "ms", "algbw GB/s", "busbw GB/s");
    }
    for (int c = 0; c < 3; c++) {
        for (int i = 0; i < warmup + iters; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t = MPI_Wtime();
            if (c == 0) MPI_Allreduce(send, recv, elems, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (c == 1) MPI_Reduce_scatter(send, recv, counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else MPI_Allgatherv(send, counts[rank], MPI_FLOAT, recv, counts, displs, MPI_FLOAT, MPI_COMM_WORLD);
            t = MPI_Wtime() - t;
            double slowest;
            MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (i >= warmup) times[i - warmup] = slowest;
        }
        qsort(times, iters, sizeof(double), cmp);
        double median = times[iters / 2], algbw = bytes / median / 1e9;
        if (rank == 0) printf("%-16s%10.3f%14.2f%14.2f\n", names[c], median * 1e3, algbw, algbw * bus[c]);
    }
    MPI_Finalize();
    return 0;
}
