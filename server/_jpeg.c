/* stoker.server._jpeg: a JPEG decoded for one crop box at one output size, in one call.
 *
 * Against the system's libjpeg (libjpeg-turbo's libjpeg API: jpeg_crop_scanline,
 * jpeg_skip_scanlines, scale_num/scale_denom). For a box (x0, y0, x1, y1) in source pixels
 * and an output of out_w x out_h:
 *   - the DCT-domain scale 1/8, 1/4 or 1/2, the smallest that leaves the box at least as
 *     large as the output on both sides (1/1 otherwise);
 *   - only the rows and columns the resample reads are decoded: columns cropped at iMCU
 *     granularity (jpeg_crop_scanline, with a margin so that the upsampled chroma of the
 *     needed columns is the full decode's), rows above skipped (jpeg_skip_scanlines), the
 *     decode stopped after the last needed row;
 *   - one separable resample, vertical pass first, its rows written transposed, then the
 *     horizontal pass along those (both vectorised over contiguous lines) with the mirror
 *     fused in, written straight into the caller's buffer, HWC or CHW. Shrinking an axis (with antialias) averages the output
 *     pixel's footprint: at full scale Pillow's BOX footprint (the pixels whose centres lie
 *     in it, equally weighted), after a DCT scale the exact area (each pixel weighted by its
 *     overlap); enlarging it, or without antialias, is bilinear with half-pixel centres.
 *     Fixed point: weights of 14 bits, non-negative, summing to exactly 1 << 14, so no
 *     clamping is needed; uint8 in, uint8 out, no float image.
 *   - the accurate integer IDCT (JDCT_ISLOW) and fancy upsampling, Pillow's: a box of the
 *     output's size is Pillow's pixels exactly. The fast IDCT (`fast=True`) measured 3% less
 *     CPU and 4-14 dB further from the reference (tests/test_crop_decode.py).
 * The GIL is released for the decode and the resample. libjpeg's errors (and its warnings:
 * corrupt data) become a ValueError; decode_crop returns False for JPEGs it does not take
 * (CMYK/YCCK, or anything jpeg_crop_scanline refuses), which the caller decodes another way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <jpeglib.h>

#define PREC 14
#define ONE (1 << PREC)

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* -- errors ------------------------------------------------------------------------------ */

struct err {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct err *e = (struct err *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, e->message);
    longjmp(e->jump, 1);
}

/* Warnings (corrupt data: a premature end, extraneous bytes) are errors here: the caller
 * then decodes the file the other way, which says what is wrong with it. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) {
        struct err *e = (struct err *)cinfo->err;
        (*cinfo->err->format_message)(cinfo, e->message);
        longjmp(e->jump, 1);
    }
}

/* -- resample weights ----------------------------------------------------------------------- */

/* One axis: output i reads `len` source pixels from first[i] (relative to the decoded span),
 * with weights w[i * taps + k] (zero beyond its own count). */
struct axis {
    int *first;
    int *count; /* weights of output i (rounded up to even: pairs) */
    int32_t *w;
    int taps;
    int lo, hi; /* the source pixels any output reads: [lo, hi) */
};

static void axis_free(struct axis *a) {
    free(a->first);
    free(a->count);
    free(a->w);
}

/* Fixed-point weights from float ones: rounded, then the largest takes what rounding lost,
 * so they sum to exactly ONE. */
static void quantise(const double *f, int n, int32_t *out) {
    double sum = 0;
    for (int k = 0; k < n; k++) sum += f[k];
    int total = 0, big = 0;
    if (sum <= 0) sum = 1; /* not reached: a caller gives some weight */
    for (int k = 0; k < n; k++) {
        out[k] = (int32_t)lrint(f[k] / sum * ONE);
        total += out[k];
        if (out[k] > out[big]) big = k;
    }
    out[big] += ONE - total;
}

/* Weights of `out` pixels over the box [b0, b1) of a source axis of `size` pixels. */
/* `scaled`: the DCT scale did part of the shrink (see the shrink's two footprints below). */
static int axis_make(struct axis *a, int size, double b0, double b1, int out, int antialias,
                     int scaled) {
    double scale = (b1 - b0) / out;
    int frac = scaled;
    int area = antialias && scale > 1.0;
    int taps = area ? (int)ceil(scale) + 2 : 2;
    taps += taps & 1;
    double *f = malloc(sizeof(double) * taps);
    a->first = malloc(sizeof(int) * out);
    a->count = malloc(sizeof(int) * out);
    a->w = calloc((size_t)out * taps, sizeof(int32_t));
    a->taps = taps;
    a->lo = size;
    a->hi = 0;
    if (!f || !a->first || !a->count || !a->w) {
        free(f);
        return -1;
    }
    for (int i = 0; i < out; i++) {
        int first, n = 0;
        if (area && frac) { /* pixels the DCT scale already low-passed: each weighted by
                             * its overlap with the footprint [b0 + i scale, b0 + (i+1) scale),
                             * the exact area average (measured: 41.5 dB against the BOX
                             * reference where Pillow's footprints give 37.8, tests/
                             * test_crop_decode.py) */
            double s = b0 + i * scale, e = s + scale;
            if (s < 0) s = 0;
            if (e > size) e = size;
            first = (int)floor(s);
            int last = (int)ceil(e);
            if (last <= first) last = first + 1;
            if (last > size) { last = size; if (first >= last) first = last - 1; }
            for (int j = first; j < last && n < taps; j++) {
                double lo = j > s ? j : s, hi = j + 1 < e ? j + 1 : e;
                f[n++] = hi > lo ? hi - lo : 0.0;
            }
            double sum = 0;
            for (int k = 0; k < n; k++) sum += f[k];
            if (sum <= 0) f[0] = 1.0;
        } else if (area) { /* Pillow's BOX: the pixels whose centres lie in the output pixel's
                     * footprint, [centre - scale / 2, centre + scale / 2), averaged */
            double c = b0 + (i + 0.5) * scale, half = scale / 2;
            first = (int)floor(c - half + 0.5);
            int last = (int)floor(c + half + 0.5); /* exclusive */
            if (first < 0) first = 0;
            if (last > size) last = size;
            if (last <= first) { /* a footprint between two centres: the nearer pixel */
                first = (int)floor(c) < size ? (int)floor(c) : size - 1;
                last = first + 1;
            }
            for (int j = first; j < last && n < taps; j++) {
                double x = (j + 0.5 - c) / scale;
                f[n++] = x > -0.5 && x <= 0.5 ? 1.0 : 0.0;
            }
            double sum = 0;
            for (int k = 0; k < n; k++) sum += f[k];
            if (sum <= 0) f[0] = 1.0;
        } else { /* bilinear, half-pixel centres, edges replicated */
            double c = b0 + (i + 0.5) * scale - 0.5;
            if (c < 0) c = 0;
            if (c > size - 1) c = size - 1;
            first = (int)floor(c);
            double t = c - first;
            if (first + 1 < size) {
                f[0] = 1.0 - t;
                f[1] = t;
                n = 2;
            } else {
                f[0] = 1.0;
                n = 1;
            }
        }
        /* drop zero weights at the ends: fewer pixels read */
        while (n > 1 && f[n - 1] <= 0) n--;
        int skip = 0;
        while (skip < n - 1 && f[skip] <= 0) skip++;
        first += skip;
        n -= skip;
        a->first[i] = first;
        a->count[i] = n + (n & 1);
        quantise(f + skip, n, a->w + (size_t)i * taps);
        if (first < a->lo) a->lo = first;
        if (first + n > a->hi) a->hi = first + n;
    }
    free(f);
    return 0;
}

/* -- passes ---------------------------------------------------------------------------------- */

/* One output line from `taps` source lines of n bytes (stride `stride`), the first at
 * line first - line0; into `line` (n bytes). Vectorised over the n bytes: every pass below
 * is this one, the horizontal one over transposed lines. Weights of zero read no line (none
 * beyond the source is read). The weights sum to ONE and are non-negative: each sum fits a
 * byte after the shift, no clamping. */
CLONES
static void combine_c(const uint8_t *s, size_t stride, int n, const int32_t *w, int taps,
                      uint8_t *line, int j) {
    int32_t acc[256];
    for (; j < n; j += 256) {
        int m = n - j < 256 ? n - j : 256;
        for (int i = 0; i < m; i++) acc[i] = 1 << (PREC - 1);
        for (int k = 0; k < taps; k++) {
            int32_t wk = w[k];
            if (wk == 0) continue;
            const uint8_t *sk = s + (size_t)k * stride + j;
            for (int i = 0; i < m; i++) acc[i] += wk * sk[i];
        }
        for (int i = 0; i < m; i++) line[j + i] = (uint8_t)(acc[i] >> PREC);
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
/* 32 bytes at a time, taps in pairs: bytes widened to 16 bits and interleaved (line k, line
 * k+1), one madd by the pair of weights (each <= ONE = 1 << 14: int16) gives 8 exact 32-bit
 * sums; the same integers as combine_c, so the same bytes. */
__attribute__((target("avx2"))) static void combine_avx2(const uint8_t *s, size_t stride, int n,
                                                         const int32_t *w, int taps,
                                                         uint8_t *line) {
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32(1 << (PREC - 1));
    int j = 0;
    for (; j + 32 <= n; j += 32) {
        __m256i a0 = half, a1 = half, a2 = half, a3 = half;
        for (int k = 0; k < taps; k += 2) {
            int32_t w0 = w[k], w1 = k + 1 < taps ? w[k + 1] : 0;
            if (!w0 && !w1) continue;
            __m256i x = w0 ? _mm256_loadu_si256((const __m256i *)(s + (size_t)k * stride + j))
                           : zero;
            __m256i y = w1 ? _mm256_loadu_si256(
                                 (const __m256i *)(s + (size_t)(k + 1) * stride + j))
                           : zero;
            __m256i wp = _mm256_set1_epi32((int32_t)((uint32_t)w0 | ((uint32_t)w1 << 16)));
            __m256i lo = _mm256_unpacklo_epi8(x, y), hi = _mm256_unpackhi_epi8(x, y);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), wp));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), wp));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), wp));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), wp));
        }
        /* per 128-bit lane: a0 a1 hold bytes 0-7, a2 a3 bytes 8-15: packed back in order */
        __m256i p01 = _mm256_packs_epi32(_mm256_srai_epi32(a0, PREC), _mm256_srai_epi32(a1, PREC));
        __m256i p23 = _mm256_packs_epi32(_mm256_srai_epi32(a2, PREC), _mm256_srai_epi32(a3, PREC));
        _mm256_storeu_si256((__m256i *)(line + j), _mm256_packus_epi16(p01, p23));
    }
    combine_c(s, stride, n, w, taps, line, j);
}
#endif

/* Whether this CPU has AVX2 (set when the module loads; STOKER_JPEG_NO_AVX2 set in the
 * environment turns it off: the test compares both paths' bytes). */
static int use_avx2 = 0;

static void combine(const uint8_t *src, size_t stride, int n, const struct axis *a, int i,
                    int line0, uint8_t *line) {
    const int32_t *w = a->w + (size_t)i * a->taps;
    const uint8_t *s = src + (size_t)(a->first[i] - line0) * stride;
#ifdef HAVE_AVX2_PATH
    if (use_avx2) {
        combine_avx2(s, stride, n, w, a->taps, line);
        return;
    }
#endif
    combine_c(s, stride, n, w, a->taps, line, 0);
}

/* Vertical: `rows` output rows of `px` RGBX pixels, each from the source rows its weights
 * name, written transposed: pixel j of output row y to dst[j * rows + y] (4 bytes), so that
 * the horizontal pass reads whole source columns as contiguous lines. */
static void vertical(const uint8_t *src, size_t stride, int px, const struct axis *ay, int rows,
                     int row0, uint32_t *dst, uint8_t *line) {
    for (int y = 0; y < rows; y++) {
        combine(src, stride, px * 4, ay, y, row0, line);
        for (int j = 0; j < px; j++) memcpy(dst + (size_t)j * rows + y, line + 4 * j, 4);
    }
}

/* Horizontal, over the transposed columns (`cols` of `rows` RGBX pixels, column x at
 * cols[(x - col0) * rows]): output column i from the columns its weights name, mirrored when
 * `flip`; HWC (pixel stride 3, channel stride 1) or CHW (pixel stride 1, channel stride
 * out_w * rows) into `out`. Columns go in increasing output order, so that HWC may store 4
 * bytes a pixel, the 4th overwritten by the next column's. The same sums as a pass along the
 * rows: the bytes do not depend on the pass's direction. */
static void horizontal(const uint32_t *cols, const struct axis *ax, int out_w, int rows,
                       int col0, int flip, int chw, uint8_t *out, uint8_t *line) {
    size_t px = chw ? 1 : 3, ch = chw ? (size_t)out_w * rows : 1, row = chw ? out_w : 3 * out_w;
    for (int i = 0; i < out_w; i++) {
        int x = flip ? out_w - 1 - i : i;
        combine((const uint8_t *)cols, (size_t)rows * 4, rows * 4, ax, x, col0, line);
        uint8_t *q = out + (size_t)i * px;
        if (!chw && i + 1 < out_w) {
            for (int y = 0; y < rows; y++) memcpy(q + (size_t)y * row, line + 4 * y, 4);
            continue;
        }
        for (int y = 0; y < rows; y++) {
            uint8_t *o = q + (size_t)y * row;
            o[0] = line[4 * y];
            o[ch] = line[4 * y + 1];
            o[2 * ch] = line[4 * y + 2];
        }
    }
}

/* -- the decode ---------------------------------------------------------------------------- */

struct job {
    const uint8_t *data; /* JPEG bytes; or RGB pixels, `rows` x `cols` (resample) */
    size_t size;
    int rows, cols;
    double box[4];
    int out_w, out_h, flip, chw, antialias, fast;
    int denom; /* the DCT scale's denominator asked for; 0: the largest the box allows */
    int decode_only; /* stop after the decode (benchmarks: the decode's cost alone) */
    uint8_t *out;
    char message[JMSG_LENGTH_MAX];
    int scale; /* the DCT scale's denominator used */
};

/* Both passes over `rows` (RGBX, `stride` bytes a row, the first at source row r0 and
 * column col0) into job->out; -1 when out of memory. */
static int passes(const uint8_t *rows, size_t stride, int col0, int r0, const struct axis *ax,
                  const struct axis *ay, const struct job *job) {
    /* The horizontal pass reads only columns [ax->lo, ax->hi): the vertical one makes no
     * more than those. */
    int span = ax->hi - ax->lo, h = job->out_h;
    int widest = (span > h ? span : h) * 4;
    uint32_t *cols = malloc(sizeof(uint32_t) * (size_t)span * h);
    uint8_t *line = malloc((size_t)widest);
    int status = -1;
    if (cols && line) {
        vertical(rows + (size_t)(ax->lo - col0) * 4, stride, span, ay, h, r0, cols, line);
        horizontal(cols, ax, job->out_w, h, ax->lo, job->flip, job->chw, job->out, line);
        status = 0;
    }
    free(cols);
    free(line);
    return status;
}

enum outcome { DONE, REFUSED, FAILED, NOMEM };

static enum outcome run(struct job *job) {
    struct jpeg_decompress_struct cinfo;
    struct err err;
    struct axis ax = {0}, ay = {0};
    uint8_t *volatile rows = NULL;
    volatile enum outcome result = DONE;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = 0;
    if (setjmp(err.jump)) {
        snprintf(job->message, sizeof job->message, "%s", err.message);
        result = FAILED;
        goto done;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (unsigned char *)job->data, (unsigned long)job->size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        result = REFUSED;
        goto done;
    }
    int width = (int)cinfo.image_width, height = (int)cinfo.image_height;
    double x0 = job->box[0], y0 = job->box[1], x1 = job->box[2], y1 = job->box[3];
    int denom = job->denom ? job->denom : 1;
    for (int f = 8; f >= 2 && !job->denom; f /= 2) {
        if ((x1 - x0) / f >= job->out_w && (y1 - y0) / f >= job->out_h) {
            denom = f;
            break;
        }
    }
    cinfo.scale_num = 1;
    cinfo.scale_denom = denom;
    cinfo.out_color_space = JCS_EXT_RGBX; /* 4 bytes a pixel: one SIMD lane each */
    cinfo.dct_method = job->fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_calc_output_dimensions(&cinfo);
    int sw = (int)cinfo.output_width, sh = (int)cinfo.output_height;
    double sx = (double)sw / width, sy = (double)sh / height;
    job->scale = denom;

    if (axis_make(&ax, sw, x0 * sx, x1 * sx, job->out_w, job->antialias, denom > 1) ||
        axis_make(&ay, sh, y0 * sy, y1 * sy, job->out_h, job->antialias, denom > 1)) {
        result = NOMEM;
        goto done;
    }
    jpeg_start_decompress(&cinfo);
    /* Columns: a margin of one iMCU each side, so that the needed columns' chroma is
     * upsampled from its real neighbours, as in the full decode. */
    int imcu = cinfo.max_h_samp_factor * cinfo.min_DCT_scaled_size;
    int c0 = ax.lo - imcu, c1 = ax.hi + imcu;
    if (c0 < 0) c0 = 0;
    if (c1 > sw) c1 = sw;
    JDIMENSION xoff = (JDIMENSION)c0, cw = (JDIMENSION)(c1 - c0);
    if (cw < (JDIMENSION)sw) jpeg_crop_scanline(&cinfo, &xoff, &cw);
    int col0 = (int)xoff, span = (int)cw;
    int r0 = ay.lo, r1 = ay.hi;
    size_t stride = (size_t)span * 4;
    rows = malloc(stride * (size_t)(r1 - r0));
    if (!rows) {
        result = NOMEM;
        goto done;
    }
    if (r0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)r0);
    while ((int)cinfo.output_scanline < r1) {
        JSAMPROW row = rows + (size_t)((int)cinfo.output_scanline - r0) * stride;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    if (!job->decode_only && passes(rows, stride, col0, r0, &ax, &ay, job)) result = NOMEM;
done:
    jpeg_destroy_decompress(&cinfo); /* also ends a decode stopped early */
    axis_free(&ax);
    axis_free(&ay);
    free(rows);
    return result;
}

/* The same resample from RGB pixels (HWC, rows x cols): the rows it reads, as RGBX. */
static enum outcome run_pixels(struct job *job) {
    struct axis ax = {0}, ay = {0};
    enum outcome result = NOMEM;
    uint8_t *rows = NULL;
    int scaled = job->denom > 1;
    if (axis_make(&ax, job->cols, job->box[0], job->box[2], job->out_w, job->antialias, scaled) ||
        axis_make(&ay, job->rows, job->box[1], job->box[3], job->out_h, job->antialias, scaled))
        goto done;
    size_t span = (size_t)(ax.hi - ax.lo), stride = span * 4;
    rows = malloc(stride * (size_t)(ay.hi - ay.lo));
    if (!rows) goto done;
    for (int y = ay.lo; y < ay.hi; y++) {
        const uint8_t *s = job->data + ((size_t)y * job->cols + ax.lo) * 3;
        uint8_t *d = rows + (size_t)(y - ay.lo) * stride;
        for (size_t x = 0; x < span; x++) {
            d[4 * x] = s[3 * x];
            d[4 * x + 1] = s[3 * x + 1];
            d[4 * x + 2] = s[3 * x + 2];
            d[4 * x + 3] = 0;
        }
    }
    if (!passes(rows, stride, ax.lo, ay.lo, &ax, &ay, job)) result = DONE;
done:
    axis_free(&ax);
    axis_free(&ay);
    free(rows);
    return result;
}

/* `out` as (rows, cols) of 3 channels, HWC or CHW; -1 with a ValueError set if not. */
static int out_shape(Py_buffer *out, int chw, int *h, int *w) {
    if (out->ndim != 3 || out->itemsize != 1 || (chw ? out->shape[0] : out->shape[2]) != 3 ||
        out->shape[chw ? 1 : 0] < 1 || out->shape[chw ? 2 : 1] < 1) {
        PyErr_SetString(PyExc_ValueError, "out must be a C-contiguous uint8 array of shape "
                                          "(h, w, 3), or (3, h, w) with chw");
        return -1;
    }
    *h = (int)out->shape[chw ? 1 : 0];
    *w = (int)out->shape[chw ? 2 : 1];
    return 0;
}

static PyObject *resample(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kwargs) {
    static char *names[] = {"pixels", "box", "out", "chw", "flip", "antialias", "scaled", NULL};
    Py_buffer src, out;
    PyObject *source, *array, *result = NULL;
    struct job job = {0};
    int chw = 0, flip = 0, antialias = 1, scaled = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O(dddd)O|pppp", names, &source, &job.box[0],
                                     &job.box[1], &job.box[2], &job.box[3], &array, &chw, &flip,
                                     &antialias, &scaled))
        return NULL;
    if (PyObject_GetBuffer(source, &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(array, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (out_shape(&out, chw, &job.out_h, &job.out_w) < 0) goto end;
    if (src.ndim != 3 || src.itemsize != 1 || src.shape[2] != 3) {
        PyErr_SetString(PyExc_ValueError, "pixels must be C-contiguous uint8 (h, w, 3)");
        goto end;
    }
    job.rows = (int)src.shape[0];
    job.cols = (int)src.shape[1];
    if (!(job.box[0] >= 0 && job.box[1] >= 0 && job.box[2] > job.box[0] &&
          job.box[3] > job.box[1] && job.box[2] <= job.cols + 1e-6 &&
          job.box[3] <= job.rows + 1e-6)) {
        PyErr_SetString(PyExc_ValueError, "box must be (x0, y0, x1, y1) inside the pixels");
        goto end;
    }
    job.data = src.buf;
    job.out = out.buf;
    job.chw = chw;
    job.flip = flip;
    job.antialias = antialias;
    job.denom = scaled ? 2 : 1;
    enum outcome outcome;
    Py_BEGIN_ALLOW_THREADS
    outcome = run_pixels(&job);
    Py_END_ALLOW_THREADS
    if (outcome == DONE)
        result = Py_NewRef(Py_None);
    else
        PyErr_NoMemory();
end:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *decode_crop(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kwargs) {
    static char *names[] = {"data", "box", "out", "chw", "flip", "antialias", "fast", "scale",
                            "decode_only", NULL};
    Py_buffer data, out;
    PyObject *array;
    struct job job = {0};
    int chw = 0, flip = 0, antialias = 1, fast = 0, denom = 0, decode_only = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*(dddd)O|ppppip", names, &data,
                                     &job.box[0], &job.box[1], &job.box[2], &job.box[3], &array,
                                     &chw, &flip, &antialias, &fast, &denom, &decode_only))
        return NULL;
    if (denom != 0 && denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "scale must be 0 (chosen by the box), 1, 2, 4 or 8");
        return NULL;
    }
    if (PyObject_GetBuffer(array, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    PyObject *result = NULL;
    if (out_shape(&out, chw, &job.out_h, &job.out_w) < 0) goto end;
    if (!(job.box[0] >= 0 && job.box[1] >= 0 && job.box[2] > job.box[0] &&
          job.box[3] > job.box[1])) {
        PyErr_SetString(PyExc_ValueError, "box must be (x0, y0, x1, y1) with x0 < x1, y0 < y1");
        goto end;
    }
    job.data = data.buf;
    job.size = (size_t)data.len;
    job.out = out.buf;
    job.chw = chw;
    job.flip = flip;
    job.antialias = antialias;
    job.fast = fast;
    job.denom = denom;
    job.decode_only = decode_only;
    enum outcome outcome;
    Py_BEGIN_ALLOW_THREADS
    outcome = run(&job);
    Py_END_ALLOW_THREADS
    switch (outcome) {
    case DONE:
        result = PyLong_FromLong(job.scale);
        break;
    case REFUSED:
        result = Py_NewRef(Py_False);
        break;
    case FAILED:
        PyErr_Format(PyExc_ValueError, "JPEG: %s", job.message);
        break;
    case NOMEM:
        PyErr_NoMemory();
        break;
    }
end:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"resample", (PyCFunction)(void (*)(void))resample, METH_VARARGS | METH_KEYWORDS,
     "resample(pixels, box, out, chw=False, flip=False, antialias=True, scaled=False)\n"
     "decode_crop's resample, from RGB uint8 pixels (h, w, 3): the same bytes as\n"
     "decode_crop gives for the same box (in these pixels), where these are the pixels it\n"
     "decodes (`scaled`: at the DCT scale it chose, see decode_crop(scale=))."},
    {"decode_crop", (PyCFunction)(void (*)(void))decode_crop, METH_VARARGS | METH_KEYWORDS,
     "decode_crop(data, box, out, chw=False, flip=False, antialias=True, fast=False, scale=0,\n"
     "            decode_only=False)\n"
     "Decode the JPEG `data` for `box` (x0, y0, x1, y1 in source pixels, floats) resampled\n"
     "to `out` (uint8, (h, w, 3), or (3, h, w) with chw), mirrored if `flip`. Returns the\n"
     "DCT scale's denominator used (1, 2, 4, 8; `scale` asks for one), or False for a\n"
     "JPEG it does not take; `decode_only` stops after the decode, `out` untouched (the\n"
     "decode's cost alone, for benchmarks).\n"
     "(CMYK, YCCK). ValueError on corrupt data."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg",
                                    "A JPEG decoded for one crop box (see _jpeg.c).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpeg(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && !getenv("STOKER_JPEG_NO_AVX2");
#else
    use_avx2 = 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m) PyModule_AddIntConstant(m, "VERSION", 1);
    return m;
}
