/*
 * aio-verify: random writes with Linux native AIO (io_submit, O_DIRECT), as `fio
 * --ioengine=libaio --rw=randwrite --verify` does, then every block read back and checked.
 * Built static on the host (no libaio needed: the system calls are made directly) and run
 * inside the vublk test guest (contrib/guest/e2e-workload.sh, E2E_MODE=aio-verify).
 *
 *   aio-verify DEVICE BYTES WRITES DEPTH SEED
 *
 * Block b (4 KiB) written for the n-th time holds 8-byte words: b, n, SEED, then a
 * xorshift stream seeded from (b, n, SEED). Every read must find the last generation
 * written. An I/O outstanding for more than 30 s is reported once per 30 s ("STALL", with
 * its block and age) while the program keeps waiting: a lost request or interrupt shows
 * as a STALL line, not as a silent hang. Exit status 0 when every block verifies.
 *
 * Copyright: the vublk authors. License: Apache-2.0 OR BSD-3-Clause.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BS 4096
#define MAX_DEPTH 64

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static uint64_t xorshift(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

static void fill(uint64_t *w, uint64_t block, uint64_t gen, uint64_t seed)
{
	uint64_t s = (block * 0x9E3779B97F4A7C15ULL) ^ (gen << 32) ^ seed ^ 1;
	w[0] = block;
	w[1] = gen;
	w[2] = seed;
	for (int i = 3; i < BS / 8; i++)
		w[i] = xorshift(&s);
}

struct slot {
	struct iocb cb;
	void *buf;
	uint64_t block;
	double since;
	double reported;
	int busy;
};

static aio_context_t ctx;
static struct slot slots[MAX_DEPTH];
static int depth;

/* A random block no write in flight targets (two writes of one block in flight at once
 * may land in either order). */
static uint64_t pick(uint64_t *rng, uint64_t blocks)
{
	for (;;) {
		uint64_t b = xorshift(rng) % blocks;
		int clash = 0;
		for (int i = 0; i < depth; i++)
			clash |= slots[i].busy && slots[i].block == b;
		if (!clash)
			return b;
	}
}

static int submit(struct slot *s, int write, int fd)
{
	struct iocb *p = &s->cb;
	memset(p, 0, sizeof *p);
	p->aio_fildes = fd;
	p->aio_lio_opcode = write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
	p->aio_buf = (uint64_t)(uintptr_t)s->buf;
	p->aio_nbytes = BS;
	p->aio_offset = (int64_t)(s->block * BS);
	p->aio_data = (uint64_t)(uintptr_t)s;
	s->since = s->reported = now();
	s->busy = 1;
	for (;;) {
		long r = syscall(SYS_io_submit, ctx, 1, &p);
		if (r == 1)
			return 0;
		if (r < 0 && errno == EAGAIN)
			continue;
		fprintf(stderr, "io_submit: %s\n", strerror(errno));
		return -1;
	}
}

/* Wait for at least one completion; report I/Os outstanding too long. */
static int reap(struct io_event *ev, int max)
{
	for (;;) {
		struct timespec to = {1, 0};
		long n = syscall(SYS_io_getevents, ctx, 1, max, ev, &to);
		if (n > 0)
			return (int)n;
		if (n < 0 && errno != EINTR) {
			fprintf(stderr, "io_getevents: %s\n", strerror(errno));
			return -1;
		}
		double t = now();
		for (int i = 0; i < depth; i++) {
			struct slot *s = &slots[i];
			if (s->busy && t - s->reported >= 30) {
				s->reported = t;
				printf("VUBLK-E2E: STALL block=%llu outstanding_s=%.0f\n",
				       (unsigned long long)s->block, t - s->since);
				fflush(stdout);
			}
		}
	}
}

int main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: %s DEVICE BYTES WRITES DEPTH SEED\n", argv[0]);
		return 2;
	}
	const char *dev = argv[1];
	uint64_t blocks = strtoull(argv[2], 0, 0) / BS;
	uint64_t writes = strtoull(argv[3], 0, 0);
	depth = atoi(argv[4]);
	uint64_t seed = strtoull(argv[5], 0, 0) | 1;
	if (blocks == 0 || depth < 1 || depth > MAX_DEPTH) {
		fprintf(stderr, "bad arguments\n");
		return 2;
	}
	int fd = open(dev, O_RDWR | O_DIRECT);
	if (fd < 0) {
		perror(dev);
		return 1;
	}
	uint32_t *gen = calloc(blocks, sizeof *gen);
	if (!gen || syscall(SYS_io_setup, depth, &ctx) < 0) {
		perror("setup");
		return 1;
	}
	for (int i = 0; i < depth; i++)
		if (posix_memalign(&slots[i].buf, BS, BS))
			return 1;
	struct io_event ev[MAX_DEPTH];
	uint64_t rng = seed, issued = 0, done = 0, bad = 0, written = 0;
	double t0 = now(), max_lat = 0;

	/* Writes: keep `depth` in flight. */
	for (int i = 0; i < depth && issued < writes; i++, issued++) {
		slots[i].block = pick(&rng, blocks);
		fill(slots[i].buf, slots[i].block, ++gen[slots[i].block], seed);
		if (submit(&slots[i], 1, fd))
			return 1;
	}
	while (done < issued) {
		int n = reap(ev, depth);
		if (n < 0)
			return 1;
		for (int k = 0; k < n; k++) {
			struct slot *s = (struct slot *)(uintptr_t)ev[k].data;
			double lat = now() - s->since;
			if (lat > max_lat)
				max_lat = lat;
			s->busy = 0;
			done++;
			if ((long long)ev[k].res != BS) {
				printf("VUBLK-E2E: FAIL aio-write (block %llu: result %lld)\n",
				       (unsigned long long)s->block, (long long)ev[k].res);
				return 1;
			}
			if (issued < writes) {
				uint64_t b = pick(&rng, blocks);
				s->block = b;
				fill(s->buf, b, ++gen[b], seed);
				if (submit(s, 1, fd))
					return 1;
				issued++;
			}
		}
	}
	double tw = now() - t0;
	printf("VUBLK-E2E: INFO aio-verify wrote %llu blocks in %.1f s (slowest %.2f s)\n",
	       (unsigned long long)done, tw, max_lat);
	fflush(stdout);

	/* Read back every block written, `depth` at a time, in order. */
	uint64_t next = 0;
	issued = done = 0;
	t0 = now();
	max_lat = 0;
	for (;;) {
		for (int i = 0; i < depth; i++) {
			if (slots[i].busy)
				continue;
			while (next < blocks && gen[next] == 0)
				next++;
			if (next == blocks)
				break;
			slots[i].block = next++;
			if (submit(&slots[i], 0, fd))
				return 1;
			issued++;
		}
		if (done == issued)
			break;
		int n = reap(ev, depth);
		if (n < 0)
			return 1;
		for (int k = 0; k < n; k++) {
			struct slot *s = (struct slot *)(uintptr_t)ev[k].data;
			double lat = now() - s->since;
			if (lat > max_lat)
				max_lat = lat;
			s->busy = 0;
			done++;
			static uint64_t want[BS / 8];
			fill(want, s->block, gen[s->block], seed);
			if ((long long)ev[k].res != BS || memcmp(want, s->buf, BS)) {
				if (bad++ < 10)
					printf("VUBLK-E2E: INFO aio-verify block %llu differs "
					       "(generation %u, result %lld, found block %llu gen %llu)\n",
					       (unsigned long long)s->block, gen[s->block],
					       (long long)ev[k].res,
					       (unsigned long long)((uint64_t *)s->buf)[0],
					       (unsigned long long)((uint64_t *)s->buf)[1]);
			}
			written++;
		}
	}
	printf("VUBLK-E2E: INFO aio-verify read back %llu blocks in %.1f s (slowest %.2f s), "
	       "%llu bad\n",
	       (unsigned long long)written, now() - t0, max_lat, (unsigned long long)bad);
	fflush(stdout);
	if (bad) {
		printf("VUBLK-E2E: FAIL aio-verify (%llu blocks differ)\n", (unsigned long long)bad);
		return 1;
	}
	return 0;
}
