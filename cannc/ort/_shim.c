/* cannc's native side of the ONNX Runtime plugin execution provider.
 *
 * Written for cannc, header-free apart from libc and pthread: the few ORT ABI facts it
 * relies on (OrtApi slot numbers and signatures) are declared by hand below, from ORT's
 * public C API documentation (see /work/shared/ORT_EP_NOTES.md).
 *
 * Two parts:
 *  - CreateEpFactories / ReleaseEpFactory, ORT's entry points, forward to the Python
 *    control plane (cannc.ort) once it hooked them with cannc_ep_set_callbacks;
 *  - native compute: a node (one ORT fused node = one cannc program family) keeps the
 *    specialisations Python built (cannc_prog, one per set of input shapes) and runs them
 *    from cannc_compute (= OrtNodeComputeInfo.Compute) with no Python on the fast path:
 *    inputs copied into a free execution context, the dispatcher launched on the native
 *    AI-core pool (core 0 on the calling thread), outputs copied out.
 *
 * The layouts of cannc_ctx / cannc_prog are mirrored by cannc/ort/_native.py.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

/* source identity, found in the binary by cannc.ort._native (a stale build is rebuilt) */
#ifndef CANNC_SHIM_HASH
#define CANNC_SHIM_HASH "unknown"
#endif
EXPORT const char cannc_shim_hash[] = "cannc-shim-hash:" CANNC_SHIM_HASH;

/* ---- the ORT ABI facts used (OrtApi is a table of function pointers, append-only) ---- */
typedef void OrtStatus;
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum {
    SLOT_CreateStatus = 0,
    SLOT_GetTensorMutableData = 51,
    SLOT_GetDimensionsCount = 61,
    SLOT_GetDimensions = 62,
    SLOT_GetTensorTypeAndShape = 65,
    SLOT_KernelContext_GetInput = 90,
    SLOT_KernelContext_GetOutput = 91,
    SLOT_ReleaseTensorTypeAndShapeInfo = 99,
};
typedef OrtStatus* (*CreateStatus_fn)(int code, const char* msg);
typedef OrtStatus* (*GetTensorMutableData_fn)(void* value, void** out);
typedef OrtStatus* (*GetDimensionsCount_fn)(const void* info, size_t* out);
typedef OrtStatus* (*GetDimensions_fn)(const void* info, int64_t* dims, size_t n);
typedef OrtStatus* (*GetTensorTypeAndShape_fn)(const void* value, void** out);
typedef OrtStatus* (*KernelContext_GetInput_fn)(const void* ctx, size_t index, const void** out);
typedef OrtStatus* (*KernelContext_GetOutput_fn)(void* ctx, size_t index, const int64_t* dims,
                                                 size_t ndim, void** out);
typedef void (*ReleaseTensorTypeAndShapeInfo_fn)(void* info);

#define API(nd, name) ((name##_fn)((nd)->api[SLOT_##name]))

/* ---- entry points: forwarded to Python ---------------------------------------------- */
typedef void* (*cannc_create_factories_fn)(const char*, const void*, const void*, void**,
                                           size_t, size_t*);
typedef void* (*cannc_release_factory_fn)(void*);

static cannc_create_factories_fn g_create;
static cannc_release_factory_fn g_release;

EXPORT void cannc_ep_set_callbacks(cannc_create_factories_fn create,
                                   cannc_release_factory_fn release) {
    __atomic_store_n(&g_create, create, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_release, release, __ATOMIC_SEQ_CST);
}

EXPORT void* CreateEpFactories(const char* registered_name, const void* ort_api_base,
                               const void* logger, void** factories, size_t max_factories,
                               size_t* num_factories) {
    cannc_create_factories_fn f = __atomic_load_n(&g_create, __ATOMIC_SEQ_CST);
    if (f == NULL) {
        if (num_factories) *num_factories = 0;
        return NULL;
    }
    return f(registered_name, ort_api_base, logger, factories, max_factories, num_factories);
}

EXPORT void* ReleaseEpFactory(void* factory) {
    cannc_release_factory_fn f = __atomic_load_n(&g_release, __ATOMIC_SEQ_CST);
    return f ? f(factory) : NULL;
}

/* ---- native compute --------------------------------------------------------------------- */
typedef struct cannc_ctx {
    void* sched;
    void* workspace;
    void** in_ptrs;
    void** out_ptrs;
    int64_t busy;
} cannc_ctx;

#define MAX_CTX 8
#define MAX_PROGS 256
#define MAX_CORES 256
#define COUNTER_WORDS 8  /* dispatch.COUNTER_WORDS */
#define PROFILE_WORDS 4  /* dispatch.PROFILE_WORDS */

typedef struct cannc_prog {
    int64_t nk;
    int64_t ws_stride;
    const int64_t* in_dims;
    const int64_t* out_dims;
    const int64_t* in_bytes;
    const int64_t* out_bytes;
    int64_t* prof;
    int64_t prof_runs;
    int64_t n_ctx;
    cannc_ctx* ctx[MAX_CTX];
} cannc_prog;

typedef void (*cannc_run_fn)(void* sched, int64_t nk, int64_t core, int64_t ncores,
                             void* counters, void* ws_base, int64_t ws_stride, void* times);
typedef cannc_prog* (*cannc_specialize_fn)(void* user, const int64_t* in_dims, char* err,
                                           size_t errlen);
typedef cannc_ctx* (*cannc_grow_fn)(void* user, cannc_prog* prog, char* err, size_t errlen);

typedef struct pending {          /* a specialisation being built (on its builder's stack) */
    struct pending* next;
    const int64_t* dims;
} pending;

typedef struct node {
    void** api;
    int64_t n_in, n_out, in_total, out_total, ncores;
    int64_t* in_ndim;
    int64_t* out_ndim;
    char* name;
    char** in_names;
    cannc_run_fn run;
    cannc_specialize_fn specialize;
    cannc_grow_fn grow;
    void* user;
    pthread_mutex_t mu;
    pthread_cond_t cv;            /* a context freed, a program added, a grow ended, quiet */
    int64_t nprog;
    cannc_prog* progs[MAX_PROGS];
    unsigned char growing[MAX_PROGS];
    pending* pend;
    int64_t computes;             /* cannc_compute calls inside */
    int64_t jobs;                 /* launches not yet left by every participant */
    int closing;
} node;

static inline int64_t cycles(void) {
#if defined(__x86_64__) || defined(__i386__)
    return (int64_t)__builtin_ia32_rdtsc();
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
}

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static OrtStatus* fail(node* nd, int code, const char* fmt, ...) {
    char msg[1024];
    int n = snprintf(msg, sizeof msg, "cannc node '%s': ", nd->name ? nd->name : "(unnamed)");
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof msg) vsnprintf(msg + n, sizeof msg - n, fmt, ap);
    va_end(ap);
    return API(nd, CreateStatus)(code, msg);
}

static const char* in_name(node* nd, int64_t i, char* buf, size_t len) {
    if (nd->in_names && nd->in_names[i]) snprintf(buf, len, "input %lld '%s'", (long long)i,
                                                  nd->in_names[i]);
    else snprintf(buf, len, "input %lld", (long long)i);
    return buf;
}

/* ---- the AI-core pool: ncores-1 native workers, launches queued ------------------------ */
typedef struct job {
    struct job* next;
    node* nd;
    cannc_run_fn run;
    void* sched;
    int64_t nk, ncores, ws_stride;
    void* ws;
    int64_t* counters;            /* 64-byte aligned, zeroed: nk*COUNTER_WORDS + 16 */
    int64_t* times;               /* NULL, or [nk*ncores*PROFILE_WORDS] */
    int64_t next_core;            /* next core id to hand a worker (pool lock) */
    int queued;                   /* still in the pool's queue (pool lock) */
    int refs;                     /* participants inside + the launcher (atomic) */
} job;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job* head;
    job* tail;
    int64_t queued;               /* jobs in the queue (read without the lock while spinning) */
    int64_t workers;
    int64_t sleepers;
    int64_t joined;               /* launches a worker took a core of (statistics) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0, 0};

#define WORKER_SPIN 2000          /* pause iterations (~tens of us) before blocking */

static void unqueue_locked(job* j) {
    job** p = &pool.head;
    job* prev = NULL;
    while (*p && *p != j) { prev = *p; p = &(*p)->next; }
    if (*p) {
        *p = j->next;
        if (pool.tail == j) pool.tail = prev;
        __atomic_fetch_sub(&pool.queued, 1, __ATOMIC_RELAXED);
    }
    j->queued = 0;
    j->next = NULL;
}

static void job_leave(job* j) {
    if (__atomic_sub_fetch(&j->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    node* nd = j->nd;
    free(j);
    pthread_mutex_lock(&nd->mu);
    nd->jobs--;
    if (nd->closing) pthread_cond_broadcast(&nd->cv);
    pthread_mutex_unlock(&nd->mu);
}

static void* worker_main(void* arg) {
    (void)arg;
    for (;;) {
        for (int i = 0; i < WORKER_SPIN && __atomic_load_n(&pool.queued, __ATOMIC_RELAXED) == 0;
             i++)
            cpu_pause();
        pthread_mutex_lock(&pool.mu);
        while (pool.head == NULL) {
            pool.sleepers++;
            pthread_cond_wait(&pool.cv, &pool.mu);
            pool.sleepers--;
        }
        job* j = pool.head;
        int64_t core = j->next_core++;
        __atomic_fetch_add(&j->refs, 1, __ATOMIC_ACQ_REL);
        if (j->next_core >= j->ncores) unqueue_locked(j);
        pool.joined++;
        pthread_mutex_unlock(&pool.mu);
        j->run(j->sched, j->nk, core, j->ncores, j->counters, j->ws, j->ws_stride, j->times);
        job_leave(j);
    }
    return NULL;
}

EXPORT int cannc_pool_reserve(int64_t ncores) {
    if (ncores < 1 || ncores > MAX_CORES) return -1;
    int rc = 0;
    pthread_mutex_lock(&pool.mu);
    while (pool.workers < ncores - 1) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int e = pthread_create(&t, &at, worker_main, NULL);
        pthread_attr_destroy(&at);
        if (e != 0) { rc = -1; break; }
        pool.workers++;
    }
    pthread_mutex_unlock(&pool.mu);
    return rc;
}

/* out[0] = worker threads, out[1] = launches workers joined (a core each) */
EXPORT void cannc_pool_stats(int64_t* out) {
    pthread_mutex_lock(&pool.mu);
    out[0] = pool.workers;
    out[1] = pool.joined;
    pthread_mutex_unlock(&pool.mu);
}

/* one launch of prog's schedule on ctx: core 0 here, cores 1.. on the pool; returns when
 * every kernel is complete. launch_prepare queues the job for the workers (NULL: out of
 * memory, nothing queued), launch_run runs core 0's share and leaves the job. */
static job* launch_prepare(node* nd, cannc_prog* p, cannc_ctx* c) {
    int64_t ncores = nd->ncores;
    size_t cwords = (size_t)p->nk * COUNTER_WORDS + 16;
    size_t twords = p->prof ? (size_t)p->nk * ncores * PROFILE_WORDS : 0;
    size_t head = (sizeof(job) + 63) / 64 * 64;
    size_t size = head + (cwords + twords) * sizeof(int64_t);
    void* mem = NULL;
    if (posix_memalign(&mem, 64, size) != 0) return NULL;
    memset(mem, 0, size);
    job* j = (job*)mem;
    j->nd = nd;
    j->run = nd->run;
    j->sched = c->sched;
    j->nk = p->nk;
    j->ncores = ncores;
    j->ws = c->workspace;
    j->ws_stride = p->ws_stride;
    j->counters = (int64_t*)((char*)mem + head);
    j->times = twords ? j->counters + cwords : NULL;
    j->next_core = 1;
    j->refs = 1;
    pthread_mutex_lock(&nd->mu);
    nd->jobs++;
    pthread_mutex_unlock(&nd->mu);
    if (ncores > 1) {     /* wake the workers first: they wait at the gate while we copy in */
        pthread_mutex_lock(&pool.mu);
        j->queued = 1;
        if (pool.tail) pool.tail->next = j; else pool.head = j;
        pool.tail = j;
        __atomic_fetch_add(&pool.queued, 1, __ATOMIC_RELAXED);
        if (pool.sleepers > 0) pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    return j;
}

static void launch_run(node* nd, cannc_prog* p, job* j) {
    int64_t t0 = j->times ? cycles() : 0;
    j->run(j->sched, j->nk, 0, j->ncores, j->counters, j->ws, j->ws_stride, j->times);
    if (j->ncores > 1) {  /* no core id is handed out from here on */
        pthread_mutex_lock(&pool.mu);
        if (j->queued) unqueue_locked(j);
        pthread_mutex_unlock(&pool.mu);
    }
    if (j->times) {
        /* the workers that joined stamp their last kernel just after core 0 left it */
        while (__atomic_load_n(&j->refs, __ATOMIC_ACQUIRE) > 1) sched_yield();
        int64_t prev = t0;
        for (int64_t k = 0; k < j->nk; k++) {
            const int64_t* tk = j->times + k * j->ncores * PROFILE_WORDS;
            /* core 0 walks every kernel and leaves each one when it is complete (a worker
             * the OS woke late stamps long after the fact, see runtime/profiler.py) */
            int64_t done = tk[3];
            int64_t busy = 0;
            for (int64_t c = 0; c < j->ncores; c++) busy += tk[c * PROFILE_WORDS + 2];
            __atomic_fetch_add(&p->prof[2 * k], done > prev ? done - prev : 0, __ATOMIC_RELAXED);
            __atomic_fetch_add(&p->prof[2 * k + 1], busy, __ATOMIC_RELAXED);
            prev = done;
        }
        __atomic_fetch_add(&p->prof_runs, 1, __ATOMIC_RELAXED);
    }
    (void)nd;
    job_leave(j);
}

/* ---- nodes ------------------------------------------------------------------------------- */
EXPORT void* cannc_node_new(const void* ort_api, int64_t n_in, const int64_t* in_ndim,
                            int64_t n_out, const int64_t* out_ndim, int64_t ncores,
                            cannc_run_fn run, cannc_specialize_fn specialize, cannc_grow_fn grow,
                            void* user) {
    if (!ort_api || n_in < 0 || n_out < 0 || (n_in && !in_ndim) || (n_out && !out_ndim) ||
        ncores < 1 || ncores > MAX_CORES || !run)
        return NULL;
    node* nd = calloc(1, sizeof(node));
    if (!nd) return NULL;
    nd->api = (void**)ort_api;
    nd->n_in = n_in;
    nd->n_out = n_out;
    nd->in_ndim = calloc((size_t)n_in + 1, sizeof(int64_t));
    nd->out_ndim = calloc((size_t)n_out + 1, sizeof(int64_t));
    if (!nd->in_ndim || !nd->out_ndim) goto bad;
    for (int64_t i = 0; i < n_in; i++) {
        if (in_ndim[i] < 0 || in_ndim[i] > 64) goto bad;
        nd->in_ndim[i] = in_ndim[i];
        nd->in_total += in_ndim[i];
    }
    for (int64_t i = 0; i < n_out; i++) {
        if (out_ndim[i] < 0 || out_ndim[i] > 64) goto bad;
        nd->out_ndim[i] = out_ndim[i];
        nd->out_total += out_ndim[i];
    }
    nd->ncores = ncores;
    nd->run = run;
    nd->specialize = specialize;
    nd->grow = grow;
    nd->user = user;
    if (cannc_pool_reserve(ncores) != 0) goto bad;
    pthread_mutex_init(&nd->mu, NULL);
    pthread_cond_init(&nd->cv, NULL);
    return nd;
bad:
    free(nd->in_ndim);
    free(nd->out_ndim);
    free(nd);
    return NULL;
}

/* names for error messages (optional): the fused node's and its inputs' (may be NULL) */
EXPORT int cannc_node_set_names(void* vnd, const char* name, const char* const* input_names) {
    node* nd = vnd;
    if (!nd) return -1;
    pthread_mutex_lock(&nd->mu);
    free(nd->name);
    nd->name = name ? strdup(name) : NULL;
    if (input_names) {
        if (!nd->in_names) nd->in_names = calloc((size_t)nd->n_in + 1, sizeof(char*));
        for (int64_t i = 0; nd->in_names && i < nd->n_in; i++) {
            free(nd->in_names[i]);
            nd->in_names[i] = input_names[i] ? strdup(input_names[i]) : NULL;
        }
    }
    pthread_mutex_unlock(&nd->mu);
    return 0;
}

static int prog_ok(node* nd, cannc_prog* p) {
    if (!p || p->nk < 0 || p->ws_stride < 0 || p->n_ctx < 0 || p->n_ctx > MAX_CTX) return 0;
    if ((nd->in_total && !p->in_dims) || (nd->out_total && !p->out_dims)) return 0;
    if ((nd->n_in && !p->in_bytes) || (nd->n_out && !p->out_bytes)) return 0;
    for (int64_t i = 0; i < p->n_ctx; i++)
        if (!p->ctx[i]) return 0;
    return 1;
}

static int64_t find_locked(node* nd, const int64_t* dims) {
    size_t n = (size_t)nd->in_total * sizeof(int64_t);
    for (int64_t i = 0; i < nd->nprog; i++)
        if (n == 0 || memcmp(nd->progs[i]->in_dims, dims, n) == 0) return i;
    return -1;
}

/* 0 ok, -1 bad record, -2 too many programs, -3 these shapes already have one */
static int add_locked(node* nd, cannc_prog* p) {
    if (!prog_ok(nd, p)) return -1;
    if (find_locked(nd, p->in_dims) >= 0) return -3;
    if (nd->nprog >= MAX_PROGS) return -2;
    nd->growing[nd->nprog] = 0;
    nd->progs[nd->nprog++] = p;
    pthread_cond_broadcast(&nd->cv);
    return 0;
}

EXPORT int cannc_node_add_program(void* vnd, cannc_prog* prog) {
    node* nd = vnd;
    if (!nd) return -1;
    pthread_mutex_lock(&nd->mu);
    int rc = add_locked(nd, prog);
    pthread_mutex_unlock(&nd->mu);
    return rc;
}

EXPORT void cannc_node_free(void* vnd) {
    node* nd = vnd;
    if (!nd) return;
    pthread_mutex_lock(&nd->mu);
    nd->closing = 1;
    pthread_cond_broadcast(&nd->cv);
    while (nd->computes > 0 || nd->jobs > 0) pthread_cond_wait(&nd->cv, &nd->mu);
    pthread_mutex_unlock(&nd->mu);
    pthread_cond_destroy(&nd->cv);
    pthread_mutex_destroy(&nd->mu);
    if (nd->in_names)
        for (int64_t i = 0; i < nd->n_in; i++) free(nd->in_names[i]);
    free(nd->in_names);
    free(nd->name);
    free(nd->in_ndim);
    free(nd->out_ndim);
    free(nd);
}

static void leave_compute(node* nd) {
    pthread_mutex_lock(&nd->mu);
    nd->computes--;
    if (nd->closing) pthread_cond_broadcast(&nd->cv);
    pthread_mutex_unlock(&nd->mu);
}

/* the program for dims (built by Python if need be); NULL with *st set on failure */
static cannc_prog* get_program(node* nd, const int64_t* dims, OrtStatus** st) {
    pthread_mutex_lock(&nd->mu);
    for (;;) {
        int64_t i = find_locked(nd, dims);
        if (i >= 0) {
            cannc_prog* p = nd->progs[i];
            pthread_mutex_unlock(&nd->mu);
            return p;
        }
        if (nd->nprog >= MAX_PROGS) {
            pthread_mutex_unlock(&nd->mu);
            *st = fail(nd, ORT_FAIL, "more than %d input shape combinations: no new "
                       "specialisation is made", MAX_PROGS);
            return NULL;
        }
        pending* q = nd->pend;   /* another thread building these shapes: wait for it */
        size_t n = (size_t)nd->in_total * sizeof(int64_t);
        while (q && !(n == 0 || memcmp(q->dims, dims, n) == 0)) q = q->next;
        if (!q) break;
        pthread_cond_wait(&nd->cv, &nd->mu);
    }
    if (!nd->specialize) {
        pthread_mutex_unlock(&nd->mu);
        *st = fail(nd, ORT_FAIL, "no program for these input shapes and no way to build one");
        return NULL;
    }
    pending me = {nd->pend, dims};
    nd->pend = &me;
    pthread_mutex_unlock(&nd->mu);

    char err[1024];
    err[0] = 0;
    cannc_prog* p = nd->specialize(nd->user, dims, err, sizeof err);  /* Python, no lock */
    err[sizeof err - 1] = 0;

    pthread_mutex_lock(&nd->mu);
    pending** pp = &nd->pend;
    while (*pp != &me) pp = &(*pp)->next;
    *pp = me.next;
    int rc = p ? add_locked(nd, p) : 0;
    if (rc == -3 && memcmp(p->in_dims, dims, (size_t)nd->in_total * sizeof(int64_t)) != 0) {
        rc = -4;   /* Python answered with a program for other shapes that already exist */
    }
    pthread_cond_broadcast(&nd->cv);
    int64_t found = (p && (rc == 0 || rc == -3)) ? find_locked(nd, dims) : -1;
    cannc_prog* got = found >= 0 ? nd->progs[found] : NULL;
    pthread_mutex_unlock(&nd->mu);
    if (got) return got;
    if (!p)
        *st = fail(nd, ORT_FAIL, "specialising for new input shapes failed: %s",
                   err[0] ? err : "(no message)");
    else if (rc == -1)
        *st = fail(nd, ORT_FAIL, "specialising for new input shapes returned a malformed "
                   "program record");
    else if (rc == -2)
        *st = fail(nd, ORT_FAIL, "more than %d input shape combinations", MAX_PROGS);
    else
        *st = fail(nd, ORT_FAIL, "specialising for new input shapes returned a program for "
                   "other input shapes");
    return NULL;
}

static int64_t prog_index_locked(node* nd, cannc_prog* p) {
    for (int64_t i = 0; i < nd->nprog; i++)
        if (nd->progs[i] == p) return i;
    return -1;
}

/* a free context of p, marked busy (Python grows one when all are busy and fewer than 8) */
static cannc_ctx* get_context(node* nd, cannc_prog* p, OrtStatus** st) {
    int grow_failed = 0;
    char err[1024];
    err[0] = 0;
    pthread_mutex_lock(&nd->mu);
    int64_t pi = prog_index_locked(nd, p);
    for (;;) {
        for (int64_t i = 0; i < p->n_ctx; i++)
            if (!p->ctx[i]->busy) {
                p->ctx[i]->busy = 1;
                pthread_mutex_unlock(&nd->mu);
                return p->ctx[i];
            }
        if (!nd->growing[pi]) {
            if (p->n_ctx < MAX_CTX && nd->grow && !grow_failed) {
                nd->growing[pi] = 1;
                pthread_mutex_unlock(&nd->mu);
                cannc_ctx* c = nd->grow(nd->user, p, err, sizeof err);  /* Python, no lock */
                err[sizeof err - 1] = 0;
                pthread_mutex_lock(&nd->mu);
                nd->growing[pi] = 0;
                pthread_cond_broadcast(&nd->cv);
                if (c && p->n_ctx < MAX_CTX) {
                    c->busy = 1;
                    p->ctx[p->n_ctx++] = c;
                    pthread_mutex_unlock(&nd->mu);
                    return c;
                }
                grow_failed = 1;
                continue;   /* (another context may have been freed meanwhile) */
            }
            if (p->n_ctx == 0) {  /* nothing to wait for */
                pthread_mutex_unlock(&nd->mu);
                *st = grow_failed
                    ? fail(nd, ORT_FAIL, "making an execution context failed: %s",
                           err[0] ? err : "(no message)")
                    : fail(nd, ORT_FAIL, "a program has no execution context");
                return NULL;
            }
        }
        pthread_cond_wait(&nd->cv, &nd->mu);   /* a context freed, or a grow ended */
    }
}

static void put_context(node* nd, cannc_ctx* c) {
    pthread_mutex_lock(&nd->mu);
    c->busy = 0;
    pthread_cond_broadcast(&nd->cv);
    pthread_mutex_unlock(&nd->mu);
}

#define SMALL 16

EXPORT void* cannc_compute(void* compute_info, void* vnd, void* kctx) {
    (void)compute_info;
    node* nd = vnd;
    if (!nd) return NULL;   /* cannot even make a status without the node's api */
    pthread_mutex_lock(&nd->mu);
    if (nd->closing) {
        pthread_mutex_unlock(&nd->mu);
        return fail(nd, ORT_FAIL, "compute called while the node is being released");
    }
    nd->computes++;
    pthread_mutex_unlock(&nd->mu);

    OrtStatus* st = NULL;
    int64_t dims_small[SMALL * 4];
    void* data_small[SMALL];
    int64_t* dims = nd->in_total <= SMALL * 4 ? dims_small
                                                : malloc(sizeof(int64_t) * nd->in_total);
    void** data = nd->n_in <= SMALL ? data_small : malloc(sizeof(void*) * nd->n_in);
    cannc_ctx* c = NULL;
    char nb[256];
    if (!dims || !data) {
        st = fail(nd, ORT_FAIL, "out of memory");
        goto out;
    }

    /* 1. the inputs' shapes and data */
    int64_t off = 0;
    for (int64_t i = 0; i < nd->n_in; i++) {
        const void* v = NULL;
        void* info = NULL;
        size_t nd_i = 0;
        if ((st = API(nd, KernelContext_GetInput)(kctx, (size_t)i, &v))) goto out;
        if (!v) {
            st = fail(nd, ORT_INVALID_ARGUMENT, "%s is missing", in_name(nd, i, nb, sizeof nb));
            goto out;
        }
        if ((st = API(nd, GetTensorTypeAndShape)(v, &info))) goto out;
        st = API(nd, GetDimensionsCount)(info, &nd_i);
        if (!st && (int64_t)nd_i != nd->in_ndim[i]) {
            API(nd, ReleaseTensorTypeAndShapeInfo)(info);
            st = fail(nd, ORT_INVALID_ARGUMENT, "%s has rank %lld, expected rank %lld",
                      in_name(nd, i, nb, sizeof nb), (long long)nd_i,
                      (long long)nd->in_ndim[i]);
            goto out;
        }
        if (!st && nd_i) st = API(nd, GetDimensions)(info, dims + off, nd_i);
        API(nd, ReleaseTensorTypeAndShapeInfo)(info);
        if (st) goto out;
        if ((st = API(nd, GetTensorMutableData)((void*)v, &data[i]))) goto out;
        off += (int64_t)nd_i;
    }

    /* 2. the program for these shapes, 3. a free context */
    cannc_prog* p = get_program(nd, dims, &st);
    if (!p) goto out;
    c = get_context(nd, p, &st);
    if (!c) goto out;

    /* 4. in, launch, out */
    job* j = NULL;
    if (p->nk > 0) {
        j = launch_prepare(nd, p, c);
        if (!j) {
            st = fail(nd, ORT_FAIL, "out of memory");
            goto out;
        }
    }
    for (int64_t i = 0; i < nd->n_in; i++)
        if (p->in_bytes[i] > 0) {
            if (!data[i]) {
                /* (the launch still runs: its workers are queued; the result is discarded) */
                st = fail(nd, ORT_INVALID_ARGUMENT, "%s has no data",
                          in_name(nd, i, nb, sizeof nb));
                break;
            }
            memcpy(c->in_ptrs[i], data[i], (size_t)p->in_bytes[i]);
        }
    if (j) launch_run(nd, p, j);
    if (st) goto out;
    off = 0;
    for (int64_t o = 0; o < nd->n_out; o++) {
        void* v = NULL;
        void* dst = NULL;
        if ((st = API(nd, KernelContext_GetOutput)(kctx, (size_t)o, p->out_dims + off,
                                                   (size_t)nd->out_ndim[o], &v)))
            goto out;
        off += nd->out_ndim[o];
        if (!v) {
            st = fail(nd, ORT_FAIL, "output %lld could not be allocated", (long long)o);
            goto out;
        }
        if (p->out_bytes[o] <= 0) continue;
        if ((st = API(nd, GetTensorMutableData)(v, &dst))) goto out;
        if (!dst) {
            st = fail(nd, ORT_FAIL, "output %lld has no data", (long long)o);
            goto out;
        }
        memcpy(dst, c->out_ptrs[o], (size_t)p->out_bytes[o]);
    }

out:
    if (c) put_context(nd, c);
    if (dims && dims != dims_small) free(dims);
    if (data && data != data_small) free(data);
    leave_compute(nd);
    return st;
}
