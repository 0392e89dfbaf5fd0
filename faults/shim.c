/* LD_PRELOAD allocation-fault shim for the prompt-cache harness (faults/native.py builds it).
 *
 * Interposes malloc, calloc, realloc and the aligned allocators (posix_memalign, aligned_alloc,
 * memalign: ggml's CPU buffers come from posix_memalign). While armed, call number NTH (counted from arming) returns
 * NULL with errno = ENOMEM, and in persistent mode so does every later call; C++ operator new then
 * throws std::bad_alloc. free() is not interposed: every pointer still comes from glibc.
 *
 * Arming: faultshim_arm(nth, persistent) at run time (ctypes, or dlsym(RTLD_DEFAULT) from C/C++), or
 * FAULTSHIM_NTH / FAULTSHIM_PERSISTENT in the environment, counted from load time, or - for a process
 * that cannot call us, such as llama-server - by writing "NTH PERSISTENT MIN_SIZE" to the file named by
 * FAULTSHIM_ARM_FILE and sending SIGUSR2 (NTH 0 disarms). Only allocations of at least MIN_SIZE bytes
 * (FAULTSHIM_MIN_SIZE, default 0) are counted and can fail. faultshim_fired() and, after SIGUSR2, the
 * line "faultshim: fired N" appended to FAULTS_STACKS report what fired.
 * Disarming: faultshim_disarm() returns the number of faults that fired.
 * Where a fault fired: at the moment it fails an allocation (before returning NULL, so before operator new
 * throws), the shim appends to the file named by FAULTS_STACKS the line
 * "faultshim: failed allocation #N (SIZE B, FUNCTION), stack:" and the call stack of that allocation, one
 * frame a line (at most FS_MAX_REPORTS stacks per arming, so that a persistent fault does not flood it).
 * On SIGABRT, SIGSEGV, SIGBUS or SIGFPE the shim disarms itself, appends the C stack (backtrace) to
 * the file named by FAULTS_STACKS, restores the default action and re-raises the signal.
 * A frame is written as backtrace_symbols_fd writes it, "MODULE(SYMBOL+0xOFF)[0xADDR]", followed by
 * " @0xREL", its address relative to the module's load base (dladdr): what addr2line -e MODULE takes
 * for a PIE executable or a shared object, when the symbol is not exported (faults/sites.py symbolizes).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static long fs_nth;        /* 0: disarmed */
static size_t fs_min_size; /* allocations below this size are not counted */
static int fs_persistent;
static long fs_count;
static long fs_fired;
static int fs_stacks_fd = -1;
static int fs_reporting; /* a stack is being written: an allocation made meanwhile is not reported */
static long fs_reports;  /* stacks written since arming */
#define FS_MAX_REPORTS 4

static void fs_write(const char *s);
static void fs_write_long(long v);
static void fs_write_hex(unsigned long v);
static void fs_write_stack(void);

void faultshim_arm(long nth, int persistent) {
    __atomic_store_n(&fs_nth, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&fs_count, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&fs_fired, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&fs_reports, 0, __ATOMIC_SEQ_CST);
    fs_persistent = persistent;
    __atomic_store_n(&fs_nth, nth, __ATOMIC_SEQ_CST);
}

long faultshim_disarm(void) {
    __atomic_store_n(&fs_nth, 0, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&fs_fired, __ATOMIC_SEQ_CST);
}

long faultshim_count(void) { return __atomic_load_n(&fs_count, __ATOMIC_SEQ_CST); }
long faultshim_fired(void) { return __atomic_load_n(&fs_fired, __ATOMIC_SEQ_CST); }

/* the failing allocation's call stack, written before the allocator returns NULL (no allocation here:
 * backtrace's unwinder was loaded at start, dladdr and write do not allocate) */
static void fs_report(long c, size_t size, const char *fn) {
    if (fs_stacks_fd < 0 || __atomic_add_fetch(&fs_reports, 1, __ATOMIC_SEQ_CST) > FS_MAX_REPORTS) return;
    if (__atomic_exchange_n(&fs_reporting, 1, __ATOMIC_SEQ_CST)) return;
    int saved = errno;
    fs_write("\nfaultshim: failed allocation #");
    fs_write_long(c);
    fs_write(" (");
    fs_write_long((long)size);
    fs_write(" B, ");
    fs_write(fn);
    fs_write("), stack:\n");
    fs_write_stack();
    errno = saved;
    __atomic_store_n(&fs_reporting, 0, __ATOMIC_SEQ_CST);
}

static int fs_fail_sized(size_t size, const char *fn) {
    long nth = __atomic_load_n(&fs_nth, __ATOMIC_SEQ_CST);
    if (nth <= 0 || size < fs_min_size || __atomic_load_n(&fs_reporting, __ATOMIC_SEQ_CST)) return 0;
    long c = __atomic_add_fetch(&fs_count, 1, __ATOMIC_SEQ_CST);
    if (c == nth || (fs_persistent && c > nth)) {
        __atomic_add_fetch(&fs_fired, 1, __ATOMIC_SEQ_CST);
        fs_report(c, size, fn);
        errno = ENOMEM;
        return 1;
    }
    return 0;
}

void *malloc(size_t n) { return fs_fail_sized(n, "malloc") ? NULL : __libc_malloc(n); }

void *calloc(size_t n, size_t size) { return fs_fail_sized(n * size, "calloc") ? NULL : __libc_calloc(n, size); }

void *realloc(void *p, size_t n) {
    if (n != 0 && fs_fail_sized(n, "realloc")) return NULL; /* realloc(p, 0) frees: never fails */
    return __libc_realloc(p, n);
}

int posix_memalign(void **memptr, size_t alignment, size_t size) {
    if (fs_fail_sized(size, "posix_memalign")) return ENOMEM;
    void *p = __libc_memalign(alignment, size);
    if (p == NULL) return ENOMEM;
    *memptr = p;
    return 0;
}

void *aligned_alloc(size_t alignment, size_t size) {
    return fs_fail_sized(size, "aligned_alloc") ? NULL : __libc_memalign(alignment, size);
}

void *memalign(size_t alignment, size_t size) {
    return fs_fail_sized(size, "memalign") ? NULL : __libc_memalign(alignment, size);
}

static const char *fs_arm_file;

static long fs_parse(const char **p) {
    long v = 0;
    while (**p == ' ' || **p == '\n') (*p)++;
    while (**p >= '0' && **p <= '9') v = v * 10 + (*(*p)++ - '0');
    return v;
}

static void fs_write_long(long v) {
    char buf[24];
    int i = sizeof buf - 1;
    buf[i] = 0;
    do { buf[--i] = (char)('0' + v % 10); v /= 10; } while (v && i > 0);
    fs_write(buf + i);
}

/* SIGUSR2: report what fired so far, then re-arm from FAULTSHIM_ARM_FILE (async-signal-safe calls only) */
static void fs_on_usr2(int sig) {
    (void)sig;
    int saved = errno;
    fs_write("faultshim: fired ");
    fs_write_long(__atomic_load_n(&fs_fired, __ATOMIC_SEQ_CST));
    fs_write("\n");
    char buf[96];
    ssize_t n = -1;
    if (fs_arm_file) {
        int fd = open(fs_arm_file, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) { n = read(fd, buf, sizeof buf - 1); close(fd); }
    }
    if (n > 0) {
        buf[n] = 0;
        const char *p = buf;
        long nth = fs_parse(&p), pers = fs_parse(&p), min = fs_parse(&p);
        __atomic_store_n(&fs_nth, 0, __ATOMIC_SEQ_CST);
        fs_min_size = (size_t)min;
        if (nth > 0) faultshim_arm(nth, (int)pers);
    }
    errno = saved;
}

static void fs_write(const char *s) {
    if (fs_stacks_fd >= 0 && write(fs_stacks_fd, s, strlen(s)) < 0) { /* nothing to do */ }
}

static void fs_write_hex(unsigned long v) {
    char buf[24];
    int i = sizeof buf - 1;
    buf[i] = 0;
    do { buf[--i] = "0123456789abcdef"[v & 15]; v >>= 4; } while (v && i > 2);
    buf[--i] = 'x';
    buf[--i] = '0';
    fs_write(buf + i);
}

/* this thread's call stack, one frame a line: "MODULE(SYMBOL+0xOFF)[0xADDR] @0xREL" */
static void fs_write_stack(void) {
    void *frames[64];
    int n = backtrace(frames, 64);
    for (int i = 0; i < n; i++) {
        Dl_info info;
        unsigned long addr = (unsigned long)frames[i];
        if (dladdr(frames[i], &info) == 0 || info.dli_fname == NULL) {
            fs_write("??[");
            fs_write_hex(addr);
            fs_write("]\n");
            continue;
        }
        fs_write(info.dli_fname);
        fs_write("(");
        if (info.dli_sname != NULL && info.dli_saddr != NULL) {
            fs_write(info.dli_sname);
            fs_write("+");
            fs_write_hex(addr - (unsigned long)info.dli_saddr);
        } else {
            fs_write("+");
            fs_write_hex(addr - (unsigned long)info.dli_fbase);
        }
        fs_write(")[");
        fs_write_hex(addr);
        fs_write("] @");
        fs_write_hex(addr - (unsigned long)info.dli_fbase);
        fs_write("\n");
    }
}

static void fs_on_fatal(int sig) {
    __atomic_store_n(&fs_nth, 0, __ATOMIC_SEQ_CST);
    fs_write("\nnative stack (faultshim, signal ");
    fs_write(sig == SIGABRT ? "SIGABRT" : sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "SIGFPE");
    fs_write("):\n");
    fs_write_stack();
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void fs_init(void) {
    const char *path = getenv("FAULTS_STACKS");
    if (path && *path) {
        void *frames[2];
        fs_stacks_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
        Dl_info info;
        backtrace(frames, 2); /* load libgcc's unwinder now, not inside a signal handler or malloc */
        if (dladdr((void *)fs_init, &info) == 0) { /* bind dladdr now too */ }
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = fs_on_fatal;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_NODEFER;
        sigaction(SIGABRT, &sa, NULL);
        sigaction(SIGSEGV, &sa, NULL);
        sigaction(SIGBUS, &sa, NULL);
        sigaction(SIGFPE, &sa, NULL);
    }
    const char *min = getenv("FAULTSHIM_MIN_SIZE");
    if (min && *min) fs_min_size = (size_t)strtoul(min, NULL, 10);
    fs_arm_file = getenv("FAULTSHIM_ARM_FILE");
    if (fs_arm_file && *fs_arm_file) {
        struct sigaction su;
        memset(&su, 0, sizeof su);
        su.sa_handler = fs_on_usr2;
        sigemptyset(&su.sa_mask);
        su.sa_flags = SA_RESTART;
        sigaction(SIGUSR2, &su, NULL);
    }
    const char *nth = getenv("FAULTSHIM_NTH");
    if (nth && *nth) {
        const char *pers = getenv("FAULTSHIM_PERSISTENT");
        faultshim_arm(strtol(nth, NULL, 10), pers && *pers == '1');
    }
}
