/* A small load program against Debian's librocksdb (C API), for the nearlog RocksDB crash test
 * and `understudy bench nearlog apps`. Compiled on demand with `cc ... -lrocksdb`.
 *
 *   load  DB WALDIR SYNC                 puts k1, k2, ... for ever; prints i once put i returned
 *   check DB WALDIR                      prints the n such that k1..kn are all there with their
 *                                        values (and fails on a wrong value)
 *   bench DB WALDIR SYNC THREADS SECS VALUE_BYTES LATFILE
 *                                        THREADS writers for SECS; prints "ops seconds"; writes
 *                                        every put's latency (u32 microseconds) to LATFILE
 *   fill  DB WALDIR BYTES VALUE_BYTES [BATCH]
 *                                        synced puts (BATCH per synced write, default 64) until
 *                                        the WAL holds BYTES, then prints "filled" and waits to
 *                                        be killed (memtable never flushed)
 *   open  DB WALDIR                      opens (recovers) the DB, prints the open's seconds and
 *                                        the number of keys
 *
 * SYNC is 1 (WriteOptions.sync: the WAL is fsync'd before a put returns) or 0 (not synced). The
 * WAL lives in WALDIR (Options.wal_dir), apart from the SST files and the MANIFEST in DB.
 */
#include <rocksdb/c.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what, char *err) {
    fprintf(stderr, "nearlog_rocksdb: %s: %s\n", what, err ? err : "failed");
    exit(2);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static rocksdb_t *open_db(const char *path, const char *wal, size_t write_buffer) {
    rocksdb_options_t *o = rocksdb_options_create();
    rocksdb_options_set_create_if_missing(o, 1);
    rocksdb_options_set_wal_dir(o, wal);
    rocksdb_options_set_write_buffer_size(o, write_buffer);
    rocksdb_options_set_max_background_jobs(o, 2);
    char *err = NULL;
    rocksdb_t *db = rocksdb_open(o, path, &err);
    if (err) die("open", err);
    rocksdb_options_destroy(o);
    return db;
}

static void value_of(char *buf, size_t len, unsigned long i) {
    int n = snprintf(buf, len + 1, "v%lu-", i);
    for (size_t j = (size_t)n; j < len; j++) buf[j] = 'a' + (char)((i + j) % 26);
}

struct worker {
    rocksdb_t *db;
    rocksdb_writeoptions_t *wo;
    int id;
    double end;
    size_t value_bytes;
    uint32_t *lat;
    size_t n, cap;
};

static void *bench_worker(void *arg) {
    struct worker *w = arg;
    char key[64];
    char *val = malloc(w->value_bytes + 32);
    for (unsigned long i = 0;; i++) {
        double t0 = now_s();
        if (t0 >= w->end) break;
        int kl = snprintf(key, sizeof key, "t%d:%lu", w->id, i);
        value_of(val, w->value_bytes, i);
        char *err = NULL;
        rocksdb_put(w->db, w->wo, key, kl, val, w->value_bytes, &err);
        if (err) die("put", err);
        if (w->n == w->cap) {
            w->cap = w->cap ? w->cap * 2 : 1 << 16;
            w->lat = realloc(w->lat, w->cap * sizeof *w->lat);
            if (!w->lat) die("realloc", NULL);
        }
        w->lat[w->n++] = (uint32_t)((now_s() - t0) * 1e6);
    }
    free(val);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s load|check|bench|fill|open DB WALDIR ...\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1], *path = argv[2], *wal = argv[3];
    char key[64], val[4096 + 64];
    char *err = NULL;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(mode, "load") && argc == 5) {
        /* A small memtable: flushes to SST files (bulk) and WAL rotation/deletion happen
         * during the load, so recovery needs the SSTs and the live WALs together. */
        rocksdb_t *db = open_db(path, wal, 256 << 10);
        rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
        rocksdb_writeoptions_set_sync(wo, atoi(argv[4]));
        for (unsigned long i = 1;; i++) {
            int kl = snprintf(key, sizeof key, "k%lu", i);
            value_of(val, 100 + i % 200, i);
            rocksdb_put(db, wo, key, kl, val, 100 + i % 200, &err);
            if (err) die("put", err);
            printf("%lu\n", i);
        }
    } else if (!strcmp(mode, "check") && argc == 4) {
        rocksdb_t *db = open_db(path, wal, 256 << 10);
        rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
        unsigned long i;
        for (i = 1;; i++) {
            int kl = snprintf(key, sizeof key, "k%lu", i);
            size_t vl = 0;
            char *v = rocksdb_get(db, ro, key, kl, &vl, &err);
            if (err) die("get", err);
            if (!v) break;
            value_of(val, 100 + i % 200, i);
            if (vl != 100 + i % 200 || memcmp(v, val, vl)) {
                fprintf(stderr, "nearlog_rocksdb: k%lu has a wrong value\n", i);
                return 1;
            }
            rocksdb_free(v);
        }
        printf("%lu\n", i - 1);
        rocksdb_close(db);
    } else if (!strcmp(mode, "bench") && argc == 9) {
        int threads = atoi(argv[5]);
        double secs = atof(argv[6]);
        size_t value_bytes = (size_t)atol(argv[7]);
        rocksdb_t *db = open_db(path, wal, 64 << 20);
        rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
        rocksdb_writeoptions_set_sync(wo, atoi(argv[4]));
        struct worker *ws = calloc(threads, sizeof *ws);
        pthread_t *ts = calloc(threads, sizeof *ts);
        double start = now_s();
        for (int t = 0; t < threads; t++) {
            ws[t] = (struct worker){db, wo, t, start + secs, value_bytes, NULL, 0, 0};
            pthread_create(&ts[t], NULL, bench_worker, &ws[t]);
        }
        size_t ops = 0;
        FILE *f = fopen(argv[8], "wb");
        if (!f) die("latency file", NULL);
        for (int t = 0; t < threads; t++) {
            pthread_join(ts[t], NULL);
            ops += ws[t].n;
            fwrite(ws[t].lat, sizeof(uint32_t), ws[t].n, f);
        }
        double el = now_s() - start;
        fclose(f);
        printf("%zu %f\n", ops, el);
        rocksdb_close(db);
    } else if (!strcmp(mode, "fill") && (argc == 6 || argc == 7)) {
        long bytes = atol(argv[4]);
        size_t value_bytes = (size_t)atol(argv[5]);
        unsigned long batch = argc == 7 ? strtoul(argv[6], NULL, 10) : 64;
        if (batch == 0) batch = 64;
        rocksdb_t *db = open_db(path, wal, 1024L << 20);
        rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
        rocksdb_writeoptions_set_sync(wo, 1);
        rocksdb_writebatch_t *b = rocksdb_writebatch_create();
        long written = 0;
        char *big = malloc(value_bytes + 64);
        for (unsigned long i = 1; written < bytes; i++) {
            int kl = snprintf(key, sizeof key, "k%lu", i);
            value_of(big, value_bytes, i);
            rocksdb_writebatch_put(b, key, kl, big, value_bytes);
            written += kl + value_bytes + 16;
            if (i % batch == 0) {
                rocksdb_write(db, wo, b, &err);
                if (err) die("write", err);
                rocksdb_writebatch_clear(b);
            }
        }
        rocksdb_write(db, wo, b, &err);
        if (err) die("write", err);
        printf("filled\n");
        for (;;) pause();
    } else if (!strcmp(mode, "open") && argc == 4) {
        double t0 = now_s();
        rocksdb_t *db = open_db(path, wal, 1024L << 20);
        double el = now_s() - t0;
        rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
        rocksdb_iterator_t *it = rocksdb_create_iterator(db, ro);
        unsigned long n = 0;
        for (rocksdb_iter_seek_to_first(it); rocksdb_iter_valid(it); rocksdb_iter_next(it)) n++;
        rocksdb_iter_destroy(it);
        printf("%f %lu\n", el, n);
        rocksdb_close(db);
    } else {
        fprintf(stderr, "nearlog_rocksdb: bad arguments\n");
        return 2;
    }
    return 0;
}
