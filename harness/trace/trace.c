/* LD_PRELOAD interposer: a trace of what a process (llama-server) asks of libllama (harness/trace/calls.py builds it).
 *
 * Compiled at run time against the tree's own include/llama.h (so every struct layout is the tree's), it
 * wraps, through dlsym(RTLD_NEXT), every libllama call that touches a context's memory or state and the
 * logits read back, and appends one JSON object a line to the file named by LLAMA_TRACE:
 *
 *   model     llama_model_load_from_file: the path
 *   ctx       llama_init_from_model: the llama_context_params that decide the computation, and what the
 *             context resolved (llama_n_ctx, n_batch, n_ubatch, n_seq_max), n_vocab
 *   free      llama_free
 *   process   llama_process (the extended batch API the server uses): the whole batch, written BEFORE the
 *             call (a crash inside keeps it): tok (-1: an embedding row), pos (first position), seq
 *             (an int, or a list when a row belongs to several sequences), out (the rows that want
 *             output), embd ([row, n_embd] of rows carrying an embedding); then a "ret" line
 *   decode / encode   the legacy llama_batch API, the same fields (pos null: positions left to libllama)
 *   seq_rm, seq_cp, seq_keep, seq_add, seq_div, clear, pos_min, pos_max    llama_memory_*, with results
 *   state_*   llama_state_seq_get_size/get_data/set_data and their _ext (flags), the whole-context
 *             llama_state_get_data/set_data: sizes, results and a hash of the bytes
 *   logits    llama_get_logits_ith: the index, a hash of the whole row (FNV-1a 64 over n_vocab floats),
 *             the top-k (id, value) and, when n_vocab <= LLAMA_TRACE_ROW_MAX, the whole row as the hex
 *             of each float's bits; llama_get_logits: the call only
 *
 * Bounded: when the next line would take the file past LLAMA_TRACE_MAX_BYTES (default 64 MiB) one
 * {"ev":"truncated"} line is written and nothing more. Each line is one write(2) of an O_APPEND file,
 * so a crash keeps every line written before it. Records carry "i", their order in the process.
 * Without LLAMA_TRACE every wrapper only passes the call on. A batch under construction
 * (llama_batch_ext_*) is shadowed per batch pointer; the shadow's memory comes from __libc_malloc so
 * that the fault shim (faults/shim.c), preloaded beside this, never counts or fails it.
 * llamatrace_hash() is exported for the reader (harness/trace/calls.py) to hash rows the same way.
 *
 * One source for every API generation: lt_features.h, written by calls.py from the tree's llama.h, says what
 * the tree has (LT_HAS_BATCH_EXT: the extended batch API with llama_process, the server's from between b10816 and b11434;
 * LT_HAS_<field>: the llama_context_params fields that came later). A tree without the extended batch API
 * is traced through llama_decode (the "decode" lines); a field the tree lacks is left out of its "ctx" line.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llama.h"
#include "lt_features.h"

extern void *__libc_malloc(size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);

#define REAL(name)                                                                        \
    static __typeof__(&name) real_##name;                                                 \
    if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

uint64_t llamatrace_hash(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ULL; }
    return h;
}

/* ---- the file and the line buffer ------------------------------------------------------------ */

static pthread_mutex_t lt_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static int lt_fd = -1;
static long long lt_written, lt_max = 64LL << 20;
static long long lt_seq;
static int lt_topk = 10, lt_row_max = 1024, lt_truncated;

#define LT_CAP (8 << 20)
static char lt_buf[LT_CAP];
static size_t lt_len;
static int lt_over;

static void put(const char *s) {
    size_t n = strlen(s);
    if (lt_len + n + 2 > LT_CAP) { lt_over = 1; return; }
    memcpy(lt_buf + lt_len, s, n);
    lt_len += n;
}
static void putf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void putf(const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    put(tmp);
}

static void begin(const char *ev) {
    lt_len = 0;
    lt_over = 0;
    putf("{\"i\":%lld,\"ev\":\"%s\"", lt_seq++, ev);
}

static void emit(void) {
    put("}\n");
    if (lt_over) { lt_len = 0; putf("{\"i\":%lld,\"ev\":\"overflow\"}\n", lt_seq - 1); }
    if (lt_fd < 0 || lt_truncated) return;
    if (lt_written + (long long)lt_len > lt_max) {
        static const char t[] = "{\"ev\":\"truncated\"}\n";
        if (write(lt_fd, t, sizeof t - 1) > 0) { /* nothing */ }
        lt_truncated = 1;
        return;
    }
    size_t off = 0;
    while (off < lt_len) {
        ssize_t w = write(lt_fd, lt_buf + off, lt_len - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    lt_written += (long long)off;
}

static int on(void) { return lt_fd >= 0 && !lt_truncated; }

/* ---- ids: models, contexts, memories ---------------------------------------------------------- */

#define LT_MAX_IDS 64
static const void *lt_models[LT_MAX_IDS];
static const void *lt_ctxs[LT_MAX_IDS];
static const void *lt_mems[LT_MAX_IDS];
static int lt_n_vocab[LT_MAX_IDS];
static int lt_n_models, lt_n_ctxs;

static int model_id(const void *m) {
    for (int i = 0; i < lt_n_models; i++) if (lt_models[i] == m) return i;
    return -1;
}
static int ctx_id(const void *c) {
    for (int i = lt_n_ctxs - 1; i >= 0; i--) if (lt_ctxs[i] == c) return i;
    return -1;
}
static int mem_ctx(const void *m) {
    for (int i = lt_n_ctxs - 1; i >= 0; i--) if (lt_mems[i] == m) return i;
    return -1;
}

/* ---- the shadow of each llama_batch_ext under construction ------------------------------------ */

#define LT_MAX_SEQ 8
struct lt_row {
    int32_t tok, pos;
    int8_t out, embd, nseq;
    int32_t seq[LT_MAX_SEQ];
    uint32_t n_embd;
};
struct lt_shadow {
    const void *b;
    const void *ctx;
    struct lt_row *rows;
    int n, cap;
};
#define LT_MAX_BATCHES 64
static struct lt_shadow lt_batches[LT_MAX_BATCHES];

__attribute__((unused)) static struct lt_shadow *shadow(const void *b, int create) {
    struct lt_shadow *free_one = NULL;
    for (int i = 0; i < LT_MAX_BATCHES; i++) {
        if (lt_batches[i].b == b) return &lt_batches[i];
        if (!lt_batches[i].b && !free_one) free_one = &lt_batches[i];
    }
    if (!create || !free_one) return NULL;
    memset(free_one, 0, sizeof *free_one);
    free_one->b = b;
    return free_one;
}

__attribute__((unused)) static struct lt_row *row(struct lt_shadow *s, int idx) {
    if (!s || idx < 0) return NULL;
    if (idx >= s->cap) {
        int cap = s->cap ? s->cap : 64;
        while (cap <= idx) cap *= 2;
        struct lt_row *r = __libc_realloc(s->rows, (size_t)cap * sizeof *r);
        if (!r) return NULL;
        s->rows = r;
        s->cap = cap;
    }
    while (s->n <= idx) {
        struct lt_row *r = &s->rows[s->n++];
        memset(r, 0, sizeof *r);
        r->tok = -1;
        r->pos = -1;
    }
    return &s->rows[idx];
}

/* ---- the constructor -------------------------------------------------------------------------- */

__attribute__((constructor)) static void lt_init(void) {
    const char *path = getenv("LLAMA_TRACE");
    const char *v;
    if ((v = getenv("LLAMA_TRACE_MAX_BYTES")) && *v) lt_max = strtoll(v, NULL, 10);
    if ((v = getenv("LLAMA_TRACE_TOPK")) && *v) lt_topk = atoi(v);
    if ((v = getenv("LLAMA_TRACE_ROW_MAX")) && *v) lt_row_max = atoi(v);
    if (lt_topk < 1) lt_topk = 1;
    if (lt_topk > 64) lt_topk = 64;
    if (!path || !*path) return;
    lt_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (lt_fd < 0) return;
    pthread_mutex_lock(&lt_mu);
    begin("trace");
    putf(",\"version\":1,\"pid\":%d,\"max_bytes\":%lld,\"topk\":%d,\"row_max\":%d", (int)getpid(), lt_max,
         lt_topk, lt_row_max);
    emit();
    pthread_mutex_unlock(&lt_mu);
}

/* ---- models and contexts ---------------------------------------------------------------------- */

static void put_json_str(const char *s) {
    put("\"");
    for (; s && *s; s++) {
        if (*s == '"' || *s == '\\') putf("\\%c", *s);
        else if ((unsigned char)*s < 0x20) putf("\\u%04x", (unsigned char)*s);
        else { char c[2] = {*s, 0}; put(c); }
    }
    put("\"");
}

struct llama_model *llama_model_load_from_file(const char *path_model, struct llama_model_params params) {
    REAL(llama_model_load_from_file);
    struct llama_model *m = real_llama_model_load_from_file(path_model, params);
    if (!on()) return m;
    pthread_mutex_lock(&lt_mu);
    if (m && lt_n_models < LT_MAX_IDS) lt_models[lt_n_models++] = m;
    begin("model");
    putf(",\"model\":%d,\"path\":", m ? model_id(m) : -1);
    put_json_str(path_model);
    emit();
    pthread_mutex_unlock(&lt_mu);
    return m;
}

struct llama_context *llama_init_from_model(struct llama_model *model, struct llama_context_params p) {
    REAL(llama_init_from_model);
    struct llama_context *c = real_llama_init_from_model(model, p);
    if (!on()) return c;
    pthread_mutex_lock(&lt_mu);
    int id = -1;
    if (c && lt_n_ctxs < LT_MAX_IDS) {
        id = lt_n_ctxs++;
        REAL(llama_get_memory);
        REAL(llama_vocab_n_tokens);
        REAL(llama_model_get_vocab);
        lt_ctxs[id] = c;
        lt_mems[id] = real_llama_get_memory(c);
        lt_n_vocab[id] = real_llama_vocab_n_tokens(real_llama_model_get_vocab(model));
    }
    begin("ctx");
    putf(",\"ctx\":%d,\"model\":%d", id, model_id(model));
    putf(",\"n_ctx\":%u,\"n_batch\":%u,\"n_ubatch\":%u,\"n_seq_max\":%u", p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max);
#if LT_HAS_n_rs_seq
    putf(",\"n_rs_seq\":%u", p.n_rs_seq);
#endif
#if LT_HAS_n_outputs_max
    putf(",\"n_outputs_max\":%u", p.n_outputs_max);
#endif
#if LT_HAS_n_outputs_max_per_seq
    putf(",\"n_outputs_max_per_seq\":%u", p.n_outputs_max_per_seq);
#endif
    putf(",\"n_threads\":%d,\"n_threads_batch\":%d", p.n_threads, p.n_threads_batch);
#if LT_HAS_ctx_type
    putf(",\"ctx_type\":%d", (int)p.ctx_type);
#endif
    putf(",\"rope_scaling_type\":%d,\"pooling_type\":%d,\"attention_type\":%d", (int)p.rope_scaling_type,
         (int)p.pooling_type, (int)p.attention_type);
    putf(",\"flash_attn_type\":%d", (int)p.flash_attn_type);
    putf(",\"rope_freq_base\":%.9g,\"rope_freq_scale\":%.9g", p.rope_freq_base, p.rope_freq_scale);
    putf(",\"yarn_ext_factor\":%.9g,\"yarn_attn_factor\":%.9g,\"yarn_beta_fast\":%.9g,\"yarn_beta_slow\":%.9g",
         p.yarn_ext_factor, p.yarn_attn_factor, p.yarn_beta_fast, p.yarn_beta_slow);
    putf(",\"yarn_orig_ctx\":%u,\"type_k\":%d,\"type_v\":%d", p.yarn_orig_ctx, (int)p.type_k, (int)p.type_v);
    putf(",\"embeddings\":%s,\"offload_kqv\":%s,\"op_offload\":%s,\"swa_full\":%s,\"kv_unified\":%s",
         p.embeddings ? "true" : "false", p.offload_kqv ? "true" : "false", p.op_offload ? "true" : "false",
         p.swa_full ? "true" : "false", p.kv_unified ? "true" : "false");
    putf(",\"cb_eval\":%s,\"n_samplers\":%zu", p.cb_eval ? "true" : "false", p.n_samplers);
#if LT_HAS_ctx_other
    putf(",\"ctx_other\":%d", p.ctx_other ? ctx_id(p.ctx_other) : -1);
#endif
    if (c) {
        REAL(llama_n_ctx);
        REAL(llama_n_batch);
        REAL(llama_n_ubatch);
        REAL(llama_n_seq_max);
        putf(",\"resolved\":{\"n_ctx\":%u,\"n_batch\":%u,\"n_ubatch\":%u,\"n_seq_max\":%u}", real_llama_n_ctx(c),
             real_llama_n_batch(c), real_llama_n_ubatch(c), real_llama_n_seq_max(c));
        putf(",\"n_vocab\":%d", id >= 0 ? lt_n_vocab[id] : -1);
    }
    emit();
    pthread_mutex_unlock(&lt_mu);
    return c;
}

void llama_free(struct llama_context *ctx) {
    REAL(llama_free);
    if (on()) {
        pthread_mutex_lock(&lt_mu);
        int id = ctx_id(ctx);
        begin("free");
        putf(",\"ctx\":%d", id);
        emit();
        if (id >= 0) { lt_ctxs[id] = NULL; lt_mems[id] = NULL; }
        pthread_mutex_unlock(&lt_mu);
    }
    real_llama_free(ctx);
}

/* ---- the extended batch: shadowed while it is built, written when processed ------------------ */

#if LT_HAS_BATCH_EXT

struct llama_batch_ext *llama_batch_ext_init(struct llama_context *ctx) {
    REAL(llama_batch_ext_init);
    struct llama_batch_ext *b = real_llama_batch_ext_init(ctx);
    if (on() && b) {
        pthread_mutex_lock(&lt_mu);
        struct lt_shadow *s = shadow(b, 1);
        if (s) s->ctx = ctx;
        pthread_mutex_unlock(&lt_mu);
    }
    return b;
}

void llama_batch_ext_free(struct llama_batch_ext *batch) {
    REAL(llama_batch_ext_free);
    if (on()) {
        pthread_mutex_lock(&lt_mu);
        struct lt_shadow *s = shadow(batch, 0);
        if (s) { __libc_free(s->rows); memset(s, 0, sizeof *s); }
        pthread_mutex_unlock(&lt_mu);
    }
    real_llama_batch_ext_free(batch);
}

void llama_batch_ext_clear(struct llama_batch_ext *batch) {
    REAL(llama_batch_ext_clear);
    real_llama_batch_ext_clear(batch);
    if (!on()) return;
    pthread_mutex_lock(&lt_mu);
    struct lt_shadow *s = shadow(batch, 1);
    if (s) s->n = 0;
    pthread_mutex_unlock(&lt_mu);
}

static void added(struct llama_batch_ext *batch, int32_t idx, llama_seq_id seq, int32_t tok, uint32_t n_embd) {
    if (!on() || idx < 0) return;
    pthread_mutex_lock(&lt_mu);
    struct lt_row *r = row(shadow(batch, 1), idx);
    if (r) {
        r->tok = tok;
        r->nseq = 1;
        r->seq[0] = seq;
        r->embd = n_embd ? 1 : 0;
        r->n_embd = n_embd;
    }
    pthread_mutex_unlock(&lt_mu);
}

int32_t llama_batch_ext_add(struct llama_batch_ext *batch, llama_seq_id seq_id) {
    REAL(llama_batch_ext_add);
    int32_t idx = real_llama_batch_ext_add(batch, seq_id);
    added(batch, idx, seq_id, -1, 0);
    return idx;
}

int32_t llama_batch_ext_add_token(struct llama_batch_ext *batch, llama_seq_id seq_id, llama_token id) {
    REAL(llama_batch_ext_add_token);
    int32_t idx = real_llama_batch_ext_add_token(batch, seq_id, id);
    added(batch, idx, seq_id, id, 0);
    return idx;
}

int32_t llama_batch_ext_add_embd(struct llama_batch_ext *batch, llama_seq_id seq_id, struct llama_embd embd) {
    REAL(llama_batch_ext_add_embd);
    int32_t idx = real_llama_batch_ext_add_embd(batch, seq_id, embd);
    added(batch, idx, seq_id, -1, (uint32_t)embd.n_embd);
    return idx;
}

bool llama_batch_ext_add_seq(struct llama_batch_ext *batch, int32_t idx, llama_seq_id seq_id) {
    REAL(llama_batch_ext_add_seq);
    bool ok = real_llama_batch_ext_add_seq(batch, idx, seq_id);
    if (on() && ok) {
        pthread_mutex_lock(&lt_mu);
        struct lt_shadow *s = shadow(batch, 0);
        if (s && idx >= 0 && idx < s->n && s->rows[idx].nseq < LT_MAX_SEQ) s->rows[idx].seq[s->rows[idx].nseq++] = seq_id;
        pthread_mutex_unlock(&lt_mu);
    }
    return ok;
}

static void set_flag(struct llama_batch_ext *batch, int32_t idx, int what, int value, uint32_t n_embd) {
    if (!on()) return;
    pthread_mutex_lock(&lt_mu);
    struct lt_shadow *s = shadow(batch, 0);
    if (s && idx >= 0 && idx < s->n) {
        struct lt_row *r = &s->rows[idx];
        if (what == 0) r->out = (int8_t)value;
        else { r->embd |= (int8_t)what; r->n_embd = n_embd; }
    }
    pthread_mutex_unlock(&lt_mu);
}

bool llama_batch_ext_set_embd_token(struct llama_batch_ext *batch, int32_t idx, struct llama_embd embd) {
    REAL(llama_batch_ext_set_embd_token);
    bool ok = real_llama_batch_ext_set_embd_token(batch, idx, embd);
    if (ok) set_flag(batch, idx, 2, 1, (uint32_t)embd.n_embd);
    return ok;
}

bool llama_batch_ext_set_embd_state(struct llama_batch_ext *batch, int32_t idx, struct llama_embd embd) {
    REAL(llama_batch_ext_set_embd_state);
    bool ok = real_llama_batch_ext_set_embd_state(batch, idx, embd);
    if (ok) set_flag(batch, idx, 4, 1, (uint32_t)embd.n_embd);
    return ok;
}

bool llama_batch_ext_set_output_embd(struct llama_batch_ext *batch, int32_t idx, bool value) {
    REAL(llama_batch_ext_set_output_embd);
    bool ok = real_llama_batch_ext_set_output_embd(batch, idx, value);
    if (ok) set_flag(batch, idx, 0, value, 0);
    return ok;
}

bool llama_batch_ext_set_output_logits(struct llama_batch_ext *batch, int32_t idx, bool value) {
    REAL(llama_batch_ext_set_output_logits);
    bool ok = real_llama_batch_ext_set_output_logits(batch, idx, value);
    if (ok) set_flag(batch, idx, 0, value, 0);
    return ok;
}

bool llama_batch_ext_set_pos(struct llama_batch_ext *batch, int32_t idx, const llama_pos *pos) {
    REAL(llama_batch_ext_set_pos);
    bool ok = real_llama_batch_ext_set_pos(batch, idx, pos);
    if (on() && ok && pos) {
        pthread_mutex_lock(&lt_mu);
        struct lt_shadow *s = shadow(batch, 0);
        if (s && idx >= 0 && idx < s->n) s->rows[idx].pos = pos[0];
        pthread_mutex_unlock(&lt_mu);
    }
    return ok;
}

#endif /* LT_HAS_BATCH_EXT */

__attribute__((unused)) static void put_rows(const struct lt_row *rows, int n) {
    put(",\"tok\":[");
    for (int i = 0; i < n; i++) putf(i ? ",%d" : "%d", rows[i].tok);
    put("],\"pos\":[");
    for (int i = 0; i < n; i++) putf(i ? ",%d" : "%d", rows[i].pos);
    put("],\"seq\":[");
    for (int i = 0; i < n; i++) {
        if (i) put(",");
        if (rows[i].nseq == 1) { putf("%d", rows[i].seq[0]); continue; }
        put("[");
        for (int j = 0; j < rows[i].nseq; j++) putf(j ? ",%d" : "%d", rows[i].seq[j]);
        put("]");
    }
    put("],\"out\":[");
    int first = 1;
    for (int i = 0; i < n; i++) if (rows[i].out) { putf(first ? "%d" : ",%d", i); first = 0; }
    put("],\"embd\":[");
    first = 1;
    for (int i = 0; i < n; i++) if (rows[i].embd) { putf(first ? "[%d,%u]" : ",[%d,%u]", i, rows[i].n_embd); first = 0; }
    put("]");
}

static void ret_line(long long of, int ret) {
    begin("ret");
    putf(",\"of\":%lld,\"ret\":%d", of, ret);
    emit();
}

#if LT_HAS_BATCH_EXT
int32_t llama_process(struct llama_context *ctx, enum llama_process_type type, struct llama_batch_ext *batch) {
    REAL(llama_process);
    long long of = -1;
    if (on()) {
        pthread_mutex_lock(&lt_mu);
        struct lt_shadow *s = shadow(batch, 0);
        of = lt_seq;
        begin("process");
        putf(",\"ctx\":%d,\"type\":\"%s\",\"n\":%d", ctx_id(ctx), type == LLAMA_PROCESS_TYPE_ENCODE ? "encode" : "decode",
             s ? s->n : -1);
        if (s) put_rows(s->rows, s->n);
        emit();
        pthread_mutex_unlock(&lt_mu);
    }
    int32_t ret = real_llama_process(ctx, type, batch);
    if (of >= 0 && on()) {
        pthread_mutex_lock(&lt_mu);
        ret_line(of, ret);
        pthread_mutex_unlock(&lt_mu);
    }
    return ret;
}

#endif /* LT_HAS_BATCH_EXT */

/* ---- the legacy llama_batch ------------------------------------------------------------------- */

static long long legacy(const char *ev, struct llama_context *ctx, struct llama_batch b) {
    pthread_mutex_lock(&lt_mu);
    long long of = lt_seq;
    begin(ev);
    putf(",\"ctx\":%d,\"n\":%d", ctx_id(ctx), b.n_tokens);
    put(",\"tok\":[");
    for (int i = 0; i < b.n_tokens; i++) putf(i ? ",%d" : "%d", b.token ? b.token[i] : -1);
    put("],\"pos\":");
    if (!b.pos) put("null");
    else { put("["); for (int i = 0; i < b.n_tokens; i++) putf(i ? ",%d" : "%d", b.pos[i]); put("]"); }
    put(",\"seq\":");
    if (!b.seq_id || !b.n_seq_id) put("null");
    else {
        put("[");
        for (int i = 0; i < b.n_tokens; i++) {
            if (i) put(",");
            if (b.n_seq_id[i] == 1) { putf("%d", b.seq_id[i][0]); continue; }
            put("[");
            for (int j = 0; j < b.n_seq_id[i]; j++) putf(j ? ",%d" : "%d", b.seq_id[i][j]);
            put("]");
        }
        put("]");
    }
    put(",\"out\":");
    if (!b.logits) put("null");
    else {
        put("[");
        int first = 1;
        for (int i = 0; i < b.n_tokens; i++) if (b.logits[i]) { putf(first ? "%d" : ",%d", i); first = 0; }
        put("]");
    }
    putf(",\"embd_rows\":%s", b.embd ? "true" : "false");
    emit();
    pthread_mutex_unlock(&lt_mu);
    return of;
}

int32_t llama_decode(struct llama_context *ctx, struct llama_batch batch) {
    REAL(llama_decode);
    long long of = on() ? legacy("decode", ctx, batch) : -1;
    int32_t ret = real_llama_decode(ctx, batch);
    if (of >= 0 && on()) { pthread_mutex_lock(&lt_mu); ret_line(of, ret); pthread_mutex_unlock(&lt_mu); }
    return ret;
}

int32_t llama_encode(struct llama_context *ctx, struct llama_batch batch) {
    REAL(llama_encode);
    long long of = on() ? legacy("encode", ctx, batch) : -1;
    int32_t ret = real_llama_encode(ctx, batch);
    if (of >= 0 && on()) { pthread_mutex_lock(&lt_mu); ret_line(of, ret); pthread_mutex_unlock(&lt_mu); }
    return ret;
}

/* ---- memory ----------------------------------------------------------------------------------- */

#define MEM_BEGIN(ev)               \
    pthread_mutex_lock(&lt_mu);     \
    begin(ev);                      \
    putf(",\"ctx\":%d", mem_ctx(mem))
#define MEM_END()  \
    emit();        \
    pthread_mutex_unlock(&lt_mu)

void llama_memory_clear(llama_memory_t mem, bool data) {
    REAL(llama_memory_clear);
    real_llama_memory_clear(mem, data);
    if (!on()) return;
    MEM_BEGIN("clear");
    putf(",\"data\":%s", data ? "true" : "false");
    MEM_END();
}

bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    REAL(llama_memory_seq_rm);
    bool ok = real_llama_memory_seq_rm(mem, seq_id, p0, p1);
    if (!on()) return ok;
    MEM_BEGIN("seq_rm");
    putf(",\"seq\":%d,\"p0\":%d,\"p1\":%d,\"ret\":%s", seq_id, p0, p1, ok ? "true" : "false");
    MEM_END();
    return ok;
}

void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1) {
    REAL(llama_memory_seq_cp);
    real_llama_memory_seq_cp(mem, src, dst, p0, p1);
    if (!on()) return;
    MEM_BEGIN("seq_cp");
    putf(",\"src\":%d,\"dst\":%d,\"p0\":%d,\"p1\":%d", src, dst, p0, p1);
    MEM_END();
}

void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id) {
    REAL(llama_memory_seq_keep);
    real_llama_memory_seq_keep(mem, seq_id);
    if (!on()) return;
    MEM_BEGIN("seq_keep");
    putf(",\"seq\":%d", seq_id);
    MEM_END();
}

void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta) {
    REAL(llama_memory_seq_add);
    real_llama_memory_seq_add(mem, seq_id, p0, p1, delta);
    if (!on()) return;
    MEM_BEGIN("seq_add");
    putf(",\"seq\":%d,\"p0\":%d,\"p1\":%d,\"delta\":%d", seq_id, p0, p1, delta);
    MEM_END();
}

void llama_memory_seq_div(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    REAL(llama_memory_seq_div);
    real_llama_memory_seq_div(mem, seq_id, p0, p1, d);
    if (!on()) return;
    MEM_BEGIN("seq_div");
    putf(",\"seq\":%d,\"p0\":%d,\"p1\":%d,\"d\":%d", seq_id, p0, p1, d);
    MEM_END();
}

llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id) {
    REAL(llama_memory_seq_pos_min);
    llama_pos r = real_llama_memory_seq_pos_min(mem, seq_id);
    if (!on()) return r;
    MEM_BEGIN("pos_min");
    putf(",\"seq\":%d,\"ret\":%d", seq_id, r);
    MEM_END();
    return r;
}

llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id) {
    REAL(llama_memory_seq_pos_max);
    llama_pos r = real_llama_memory_seq_pos_max(mem, seq_id);
    if (!on()) return r;
    MEM_BEGIN("pos_max");
    putf(",\"seq\":%d,\"ret\":%d", seq_id, r);
    MEM_END();
    return r;
}

/* ---- state ------------------------------------------------------------------------------------ */

static void state_line(const char *ev, struct llama_context *ctx, int seq, long long flags, size_t size, size_t ret,
                       const void *data, size_t n_data) {
    pthread_mutex_lock(&lt_mu);
    begin(ev);
    putf(",\"ctx\":%d", ctx_id(ctx));
    if (seq >= -1) putf(",\"seq\":%d", seq);
    if (flags >= 0) putf(",\"flags\":%lld", flags);
    putf(",\"size\":%zu,\"ret\":%zu", size, ret);
    if (data) putf(",\"hash\":\"%016llx\"", (unsigned long long)llamatrace_hash(data, n_data));
    emit();
    pthread_mutex_unlock(&lt_mu);
}

size_t llama_state_seq_get_size(struct llama_context *ctx, llama_seq_id seq_id) {
    REAL(llama_state_seq_get_size);
    size_t r = real_llama_state_seq_get_size(ctx, seq_id);
    if (on()) state_line("state_seq_get_size", ctx, seq_id, -1, 0, r, NULL, 0);
    return r;
}

size_t llama_state_seq_get_data(struct llama_context *ctx, uint8_t *dst, size_t size, llama_seq_id seq_id) {
    REAL(llama_state_seq_get_data);
    size_t r = real_llama_state_seq_get_data(ctx, dst, size, seq_id);
    if (on()) state_line("state_seq_get_data", ctx, seq_id, -1, size, r, dst, r);
    return r;
}

size_t llama_state_seq_set_data(struct llama_context *ctx, const uint8_t *src, size_t size, llama_seq_id dest) {
    REAL(llama_state_seq_set_data);
    if (on()) state_line("state_seq_set_data", ctx, dest, -1, size, 0, src, size); /* before: a crash keeps it */
    size_t r = real_llama_state_seq_set_data(ctx, src, size, dest);
    if (on()) state_line("state_ret", ctx, dest, -1, size, r, NULL, 0);
    return r;
}

size_t llama_state_seq_get_size_ext(struct llama_context *ctx, llama_seq_id seq_id, llama_state_seq_flags flags) {
    REAL(llama_state_seq_get_size_ext);
    size_t r = real_llama_state_seq_get_size_ext(ctx, seq_id, flags);
    if (on()) state_line("state_seq_get_size", ctx, seq_id, flags, 0, r, NULL, 0);
    return r;
}

size_t llama_state_seq_get_data_ext(struct llama_context *ctx, uint8_t *dst, size_t size, llama_seq_id seq_id,
                                    llama_state_seq_flags flags) {
    REAL(llama_state_seq_get_data_ext);
    size_t r = real_llama_state_seq_get_data_ext(ctx, dst, size, seq_id, flags);
    if (on()) state_line("state_seq_get_data", ctx, seq_id, flags, size, r, dst, r);
    return r;
}

size_t llama_state_seq_set_data_ext(struct llama_context *ctx, const uint8_t *src, size_t size, llama_seq_id dest,
                                    llama_state_seq_flags flags) {
    REAL(llama_state_seq_set_data_ext);
    if (on()) state_line("state_seq_set_data", ctx, dest, flags, size, 0, src, size);
    size_t r = real_llama_state_seq_set_data_ext(ctx, src, size, dest, flags);
    if (on()) state_line("state_ret", ctx, dest, flags, size, r, NULL, 0);
    return r;
}

size_t llama_state_get_data(struct llama_context *ctx, uint8_t *dst, size_t size) {
    REAL(llama_state_get_data);
    size_t r = real_llama_state_get_data(ctx, dst, size);
    if (on()) state_line("state_get_data", ctx, -2, -1, size, r, dst, r);
    return r;
}

size_t llama_state_set_data(struct llama_context *ctx, const uint8_t *src, size_t size) {
    REAL(llama_state_set_data);
    if (on()) state_line("state_set_data", ctx, -2, -1, size, 0, src, size);
    size_t r = real_llama_state_set_data(ctx, src, size);
    if (on()) state_line("state_ret", ctx, -2, -1, size, r, NULL, 0);
    return r;
}

/* ---- the logits read back --------------------------------------------------------------------- */

float *llama_get_logits_ith(struct llama_context *ctx, int32_t i) {
    REAL(llama_get_logits_ith);
    float *row_p = real_llama_get_logits_ith(ctx, i);
    if (!on()) return row_p;
    pthread_mutex_lock(&lt_mu);
    int id = ctx_id(ctx);
    int n = id >= 0 ? lt_n_vocab[id] : 0;
    begin("logits");
    putf(",\"ctx\":%d,\"idx\":%d", id, i);
    if (!row_p || n <= 0) {
        put(",\"row\":null");
    } else {
        putf(",\"n_vocab\":%d,\"hash\":\"%016llx\"", n, (unsigned long long)llamatrace_hash(row_p, (size_t)n * sizeof(float)));
        int top[64];
        int k = lt_topk < n ? lt_topk : n;
        for (int j = 0; j < k; j++) top[j] = -1;
        for (int t = 0; t < n; t++) { /* insertion into the k best, ties to the lower id */
            int j = k;
            while (j > 0 && (top[j - 1] < 0 || row_p[t] > row_p[top[j - 1]])) j--;
            if (j >= k) continue;
            memmove(&top[j + 1], &top[j], (size_t)(k - j - 1) * sizeof top[0]);
            top[j] = t;
        }
        put(",\"top\":[");
        for (int j = 0; j < k; j++) putf(j ? ",[%d,%.9g]" : "[%d,%.9g]", top[j], row_p[top[j]]);
        put("]");
        if (n <= lt_row_max) {
            put(",\"bits\":\"");
            for (int t = 0; t < n; t++) {
                uint32_t u;
                memcpy(&u, &row_p[t], sizeof u);
                putf("%08x", u);
            }
            put("\"");
        }
    }
    emit();
    pthread_mutex_unlock(&lt_mu);
    return row_p;
}

float *llama_get_logits(struct llama_context *ctx) {
    REAL(llama_get_logits);
    float *r = real_llama_get_logits(ctx);
    if (!on()) return r;
    pthread_mutex_lock(&lt_mu);
    begin("logits_all");
    putf(",\"ctx\":%d", ctx_id(ctx));
    emit();
    pthread_mutex_unlock(&lt_mu);
    return r;
}
