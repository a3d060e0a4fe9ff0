/*
 * crash-fs: the file-system workload of vublk's power-loss crash states (tests/vm_crash.rs,
 * docs/crash-consistency.md). Run inside the test guest on a mounted ext4
 * (contrib/guest/e2e-workload.sh, E2E_MODE=crash-fs):
 *
 *   crash-fs DIR STEPS SEED
 *
 * It creates, appends to, overwrites, fsyncs, renames over and unlinks files in DIR, and runs
 * a database-like loop (a record rewritten in place, then fdatasync). Every 512-byte sector
 * it writes is self-describing: magic, file id, sector index in the file, write id, then
 * words derived from those, so the host can tell for each sector of a crash state which
 * write put it there.
 *
 * It tells the host what it does on the console, one line per operation, printed before the
 * operation starts:
 *
 *   VUBLK-E2E: CF C FID PATH           create PATH (a new file, id FID)
 *   VUBLK-E2E: CF W WID FID SECTOR N   write N sectors at SECTOR of file FID (write id WID)
 *   VUBLK-E2E: CF R FROM TO            rename FROM over TO
 *   VUBLK-E2E: CF U PATH               unlink PATH
 *
 * and, after each durability point returned, one line, then it waits for the host's answer:
 *
 *   VUBLK-E2E: CF S SEQ FID            fsync or fdatasync of file FID returned
 *   VUBLK-E2E: CF D SEQ                fsync of DIR returned
 *
 * The host marks its recording and writes "SEQ\n" to the console; only then does the
 * workload go on. So the recording's marks sit exactly between the operations before a
 * durability point and those after it. File names are relative to DIR.
 *
 * Copyright: the vublk authors. License: Apache-2.0 OR BSD-3-Clause.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <unistd.h>

#define SECTOR 512
#define SLOTS 6
#define DB_RECORDS 32
#define DB_SECTORS 8 /* one 4 KiB record */
#define STAMP_MAGIC 0x5642464352534653ULL /* "VBFCRSFS" */

static int dirfd_;
static uint64_t rng;
static uint32_t next_fid = 1, next_wid = 1, seq;

struct file {
	uint32_t fid;
	uint32_t sectors;
	int live;
};
static struct file slot[SLOTS], db;

static void die(const char *what)
{
	printf("VUBLK-E2E: FAIL crash-fs %s: %s\n", what, strerror(errno));
	fflush(stdout);
	exit(1);
}

static void say(const char *fmt, ...)
{
	va_list ap;
	printf("VUBLK-E2E: CF ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
}

static uint64_t next(void)
{
	/* splitmix64 */
	uint64_t z = (rng += 0x9E3779B97F4A7C15ULL);
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

static uint32_t below(uint32_t n)
{
	return (uint32_t)(next() % n);
}

/* Sector `s` of file `fid` as write `wid` writes it (tests/vm_crash.rs decodes it). */
static void stamp(unsigned char *out, uint32_t fid, uint32_t s, uint32_t wid)
{
	uint64_t head = STAMP_MAGIC;
	uint64_t z = ((uint64_t)fid << 40) ^ ((uint64_t)s << 20) ^ wid;
	memcpy(out, &head, 8);
	memcpy(out + 8, &fid, 4);
	memcpy(out + 12, &s, 4);
	memcpy(out + 16, &wid, 4);
	memcpy(out + 20, &wid, 4);
	for (int i = 24; i < SECTOR; i += 8) {
		z = z * 6364136223846793005ULL + 1442695040888963407ULL;
		memcpy(out + i, &z, 8);
	}
}

/* A durability point: tell the host, wait until it answers with the same number. */
static void durable(const char *fmt, ...)
{
	char line[64];
	va_list ap;
	printf("VUBLK-E2E: CF ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	for (;;) {
		if (!fgets(line, sizeof(line), stdin))
			die("read the host's answer");
		if ((uint32_t)strtoul(line, NULL, 10) == seq)
			break;
	}
	seq++;
}

static int open_at(const char *name, int flags)
{
	int fd = openat(dirfd_, name, flags | O_CLOEXEC, 0644);
	if (fd < 0)
		die(name);
	return fd;
}

static void write_sectors(int fd, struct file *f, uint32_t at, uint32_t n)
{
	static unsigned char buf[64 * SECTOR];
	uint32_t wid = next_wid++;
	for (uint32_t i = 0; i < n; i++)
		stamp(buf + i * SECTOR, f->fid, at + i, wid);
	say("W %u %u %u %u", wid, f->fid, at, n);
	if (pwrite(fd, buf, n * SECTOR, (off_t)at * SECTOR) != (ssize_t)(n * SECTOR))
		die("pwrite");
	if (at + n > f->sectors)
		f->sectors = at + n;
}

static void sync_file(int fd, struct file *f, int data_only)
{
	if ((data_only ? fdatasync(fd) : fsync(fd)) != 0)
		die("fsync");
	durable("S %u %u", seq, f->fid);
}

static void sync_dir(void)
{
	if (fsync(dirfd_) != 0)
		die("fsync the directory");
	durable("D %u", seq);
}

static void name_of(char *out, const char *prefix, int i)
{
	sprintf(out, "%s%d", prefix, i);
}

/* A new file at `name` with `n` sectors; fsynced with probability `sync_pct`. */
static void create(struct file *f, const char *name, uint32_t n, int sync_pct)
{
	f->fid = next_fid++;
	f->sectors = 0;
	f->live = 1;
	say("C %u %s", f->fid, name);
	int fd = open_at(name, O_WRONLY | O_CREAT | O_EXCL);
	write_sectors(fd, f, 0, n);
	if ((int)below(100) < sync_pct)
		sync_file(fd, f, 0);
	close(fd);
}

static void step(void)
{
	char name[16], tmp[16];
	int i = below(SLOTS);
	struct file *f = &slot[i];
	uint32_t r = below(100);
	name_of(name, "f", i);
	if (!f->live && r < 55)
		r = 0; /* nothing to append to or overwrite: create it */
	if (r < 15) {
		if (f->live)
			return;
		create(f, name, 1 + below(24), 80);
		if (below(100) < 80)
			sync_dir();
	} else if (r < 35) {
		int fd = open_at(name, O_WRONLY);
		write_sectors(fd, f, f->sectors, 1 + below(16));
		if (below(100) < 70)
			sync_file(fd, f, 0);
		close(fd);
	} else if (r < 55) {
		uint32_t at = below(f->sectors);
		uint32_t n = 1 + below(f->sectors - at < 16 ? f->sectors - at : 16);
		int fd = open_at(name, O_WRONLY);
		write_sectors(fd, f, at, n);
		if (below(100) < 70)
			sync_file(fd, f, 1);
		close(fd);
	} else if (r < 65) {
		/* The atomic replace: a new file, fsynced, renamed over the old one. */
		struct file t;
		name_of(tmp, "t", i);
		create(&t, tmp, 1 + below(24), 100);
		say("R %s %s", tmp, name);
		if (renameat(dirfd_, tmp, dirfd_, name) != 0)
			die("rename");
		*f = t;
		if (below(100) < 80)
			sync_dir();
	} else if (r < 73) {
		if (!f->live)
			return;
		say("U %s", name);
		if (unlinkat(dirfd_, name, 0) != 0)
			die("unlink");
		f->live = 0;
		if (below(100) < 70)
			sync_dir();
	} else {
		/* The database: records rewritten in place, each made durable before the next. */
		int fd = open_at("db", O_WRONLY);
		for (int k = 0; k < 4; k++) {
			write_sectors(fd, &db, below(DB_RECORDS) * DB_SECTORS, DB_SECTORS);
			sync_file(fd, &db, 1);
		}
		close(fd);
	}
}

int main(int argc, char **argv)
{
	struct termios t;
	if (argc != 4) {
		fprintf(stderr, "usage: crash-fs DIR STEPS SEED\n");
		return 2;
	}
	long steps = strtol(argv[2], NULL, 10);
	rng = strtoull(argv[3], NULL, 0);
	/* The host's answers must not echo back into the console's output. */
	if (tcgetattr(0, &t) == 0) {
		t.c_lflag &= ~(ECHO | ECHONL);
		t.c_lflag |= ICANON;
		tcsetattr(0, TCSANOW, &t);
	}
	dirfd_ = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dirfd_ < 0)
		die(argv[1]);
	/* The database file: every record written once, then made durable with its name. */
	db.fid = next_fid++;
	db.live = 1;
	say("C %u db", db.fid);
	int fd = open_at("db", O_WRONLY | O_CREAT | O_EXCL);
	for (uint32_t k = 0; k < DB_RECORDS; k++)
		write_sectors(fd, &db, k * DB_SECTORS, DB_SECTORS);
	sync_file(fd, &db, 0);
	close(fd);
	sync_dir();
	for (long s = 0; s < steps; s++)
		step();
	say("END writes=%u files=%u durability-points=%u", next_wid - 1, next_fid - 1, seq);
	return 0;
}
