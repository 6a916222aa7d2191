/* A native miner of swarmd's admission tickets (crdt/admission.py), for bench/bench_tickets.py: what a ticket
 * costs an attacker with a C compiler, next to the Python miner every node runs.
 *
 * The same construction: the nonce n (0 <= n < 2^64) is a ticket for (swarm, author) at `bits` when
 *   blake2b(DOMAIN | swarm | 0x00 | author | 0x00 | n as 8 bytes little-endian, digest_size=16)
 * read as a big-endian 128-bit number has `bits` leading zero bits. The message fits one 128-byte block for the
 * names swarmd allows (a swarm name of at most 64 characters, a peer id of 52), so each try is one compression.
 *
 *   cc -O3 -march=native -o ticket_miner bench/ticket_miner.c
 *   ./ticket_miner SWARM AUTHOR BITS START COUNT
 * mines COUNT tickets one after the other (each search starts after the previous ticket, the first at START) and
 * prints each nonce and the nonces it searched, then the hashes computed in all and the CPU seconds they took (one
 * core). Four nonces are hashed at once (vector lanes); TICKET_MINER_LANES=1 hashes one at a time.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y)          \
    do {                             \
        a = a + b + (x);             \
        d = ROTR(d ^ a, 32);         \
        c = c + d;                   \
        b = ROTR(b ^ c, 24);         \
        a = a + b + (y);             \
        d = ROTR(d ^ a, 16);         \
        c = c + d;                   \
        b = ROTR(b ^ c, 63);         \
    } while (0)

/* The first 8 bytes of blake2b-128 of one final block `m` (len bytes of message in all), as a big-endian number:
 * enough to count leading zero bits up to 64. */
static uint64_t head(const uint64_t m[16], uint64_t len) {
    uint64_t h0 = IV[0] ^ 0x01010000ULL ^ 16;  /* parameter block: digest 16 bytes, no key, fanout 1, depth 1 */
    uint64_t v[16] = {h0, IV[1], IV[2], IV[3], IV[4], IV[5], IV[6], IV[7],
                      IV[0], IV[1], IV[2], IV[3], IV[4] ^ len, IV[5], ~IV[6], IV[7]};
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    return __builtin_bswap64(h0 ^ v[0] ^ v[8]);  /* digest bytes 0..7 (little-endian word), read big-endian */
}

/* The same, several nonces at once (GCC/Clang vector extensions): four lanes of 256 bits (AVX2), or eight of 512
 * (AVX-512, whose vprorq rotates each 64-bit lane in one instruction). One function per width, from one macro. */
typedef uint64_t v4 __attribute__((vector_size(32)));
typedef uint64_t v8 __attribute__((vector_size(64)));
#define ROTRV(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define GV(a, b, c, d, x, y)         \
    do {                             \
        a = a + b + (x);             \
        d = ROTRV(d ^ a, 32);        \
        c = c + d;                   \
        b = ROTRV(b ^ c, 24);        \
        a = a + b + (y);             \
        d = ROTRV(d ^ a, 16);        \
        c = c + d;                   \
        b = ROTRV(b ^ c, 63);        \
    } while (0)
#define HEAD_LANES(NAME, VT)                                                  \
    static VT NAME(const VT m[16], uint64_t len) {                            \
        uint64_t h0 = IV[0] ^ 0x01010000ULL ^ 16;                             \
        VT zero = {0}, v[16];                                                 \
        for (int i = 0; i < 8; i++) {                                         \
            v[i] = zero + (i ? IV[i] : h0);                                   \
            v[i + 8] = zero + IV[i];                                          \
        }                                                                     \
        v[12] ^= len;                                                         \
        v[14] = ~v[14];                                                       \
        _Pragma("GCC unroll 12") for (int r = 0; r < 12; r++) {               \
            const uint8_t *s = SIGMA[r];                                      \
            GV(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);                    \
            GV(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);                    \
            GV(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);                   \
            GV(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);                   \
            GV(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);                   \
            GV(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);                 \
            GV(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);                  \
            GV(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);                  \
        }                                                                     \
        return v[0] ^ v[8] ^ h0;                                              \
    }
HEAD_LANES(head4, v4)
HEAD_LANES(head8, v8)

/* Search from `nonce` for a ticket below `limit` with LANES nonces a try; the nonce found. `at`: the nonce's byte
 * offset in the block. The words the nonce touches differ per lane; the others are the same in all lanes. */
#define SEARCH_LANES(NAME, VT, HEAD, LANES)                                   \
    static uint64_t NAME(const uint64_t m[16], size_t at, uint64_t len, uint64_t nonce, uint64_t limit, \
                         uint64_t *tries) {                                   \
        VT zero = {0}, mv[16];                                                \
        for (int i = 0; i < 16; i++)                                          \
            mv[i] = zero + m[i];                                              \
        int w0 = at / 8, w1 = (at + 7) / 8;                                   \
        for (;; nonce += LANES) {                                             \
            for (int lane = 0; lane < LANES; lane++) {                        \
                uint64_t lane_nonce = nonce + lane, words[16];                \
                memcpy(words, m, sizeof words);                               \
                memcpy((uint8_t *)words + at, &lane_nonce, 8);                \
                mv[w0][lane] = words[w0];                                     \
                mv[w1][lane] = words[w1];                                     \
            }                                                                 \
            VT h = HEAD(mv, len);                                             \
            *tries += LANES;                                                  \
            for (int lane = 0; lane < LANES; lane++)                          \
                if (__builtin_bswap64(h[lane]) < limit)                       \
                    return nonce + lane;                                      \
        }                                                                     \
    }
SEARCH_LANES(search4, v4, head4, 4)
SEARCH_LANES(search8, v8, head8, 8)

static uint64_t search1(uint64_t m[16], size_t at, uint64_t len, uint64_t nonce, uint64_t limit, uint64_t *tries) {
    for (;; nonce++) {
        memcpy((uint8_t *)m + at, &nonce, 8);  /* little-endian host: Python's to_bytes(8, "little") */
        ++*tries;
        if (head(m, len) < limit)
            return nonce;
    }
}

/* The one block for (swarm, author): its words in m, the nonce's offset in *at; the message length, or 0 when the
 * names do not fit one block. */
static uint64_t block_for(const char *swarm, const char *author, uint64_t m[16], size_t *at) {
    static const char DOMAIN[] = "swarmd-admit/1";  /* and its 0x00: crdt/admission.py DOMAIN */
    uint8_t block[128] = {0};
    size_t n = 0, ls = strlen(swarm), la = strlen(author);
    if (sizeof DOMAIN + ls + 1 + la + 1 + 8 > sizeof block)
        return 0;
    memcpy(block, DOMAIN, sizeof DOMAIN), n += sizeof DOMAIN;  /* includes the 0x00 */
    memcpy(block + n, swarm, ls), n += ls, block[n++] = 0;
    memcpy(block + n, author, la), n += la, block[n++] = 0;
    *at = n;
    memcpy(m, block, 128);
    return n + 8;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SWARM AUTHOR|- BITS START COUNT\n", argv[0]);
        return 2;
    }
    const char *swarm = argv[1], *author = argv[2];
    int bits = atoi(argv[3]);
    uint64_t first = strtoull(argv[4], NULL, 10), nonce = first;
    long count = atol(argv[5]);
    const char *env = getenv("TICKET_MINER_LANES");
#ifdef __AVX512F__
    int lanes = env ? atoi(env) : 8;
#else
    int lanes = env ? atoi(env) : 4;
#endif
    if (bits < 1 || bits > 40 || (lanes != 1 && lanes != 4 && lanes != 8)) {
        fprintf(stderr, "bits must be 1..40 and TICKET_MINER_LANES 1, 4 or 8\n");
        return 2;
    }
    uint64_t m[16], limit = 1ULL << (64 - bits), tries = 0;
    size_t at;
    struct timespec t0, t1;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
    if (strcmp(author, "-") == 0) {
        /* one ticket per author read from stdin (one a line), each searched from START: "AUTHOR NONCE TRIES" */
        char line[256];
        while (fgets(line, sizeof line, stdin)) {
            line[strcspn(line, "\r\n")] = 0;
            uint64_t len = block_for(swarm, line, m, &at), before = tries, found;
            if (!len) {
                fprintf(stderr, "names too long for one block: %s\n", line);
                return 2;
            }
            found = lanes == 8   ? search8(m, at, len, first, limit, &tries)
                    : lanes == 4 ? search4(m, at, len, first, limit, &tries)
                                 : search1(m, at, len, first, limit, &tries);
            printf("%s %llu %llu\n", line, (unsigned long long)found, (unsigned long long)(tries - before));
            fflush(stdout);
        }
    } else {
        uint64_t len = block_for(swarm, author, m, &at);
        if (!len) {
            fprintf(stderr, "the names must be short enough for one block\n");
            return 2;
        }
        for (long k = 0; k < count; k++) {
            uint64_t start = nonce;
            nonce = lanes == 8   ? search8(m, at, len, nonce, limit, &tries)
                    : lanes == 4 ? search4(m, at, len, nonce, limit, &tries)
                                 : search1(m, at, len, nonce, limit, &tries);
            printf("%llu %llu\n", (unsigned long long)nonce, (unsigned long long)(nonce - start + 1));
            nonce++;
        }
    }
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t1);
    printf("total %llu %.6f\n", (unsigned long long)tries, (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return 0;
}
