package chatpipe.spark;

import java.util.zip.CRC32;

import org.apache.spark.sql.api.java.UDF2;
import org.apache.spark.sql.api.java.UDF3;
import org.apache.spark.sql.catalyst.expressions.XXH64;
import org.apache.spark.unsafe.Platform;

/**
 * Word n-gram hashes of normalised text, for decontamination and MinHash (spark_jobs/jvm_functions.py).
 *
 * <p>Input: the job's normalised text as UTF-8 bytes (lower case, words separated by exactly one
 * space). Words are the pieces between spaces, as Spark's {@code split(text, ' ')} gives them, so the
 * n-gram that {@code NGram} would build by joining words i..i+n-1 with one space is the byte range
 * from word i's start to word i+n-1's end: it is hashed in place, no string is built. The hashes are
 * those Spark SQL computes for the same strings ({@code xxhash64} seed 42, {@code crc32}), so the
 * results equal the Spark SQL path's (tested) and the Python baseline's.
 *
 * <p>Why a Java function: the Spark SQL path exploded every n-gram into a row of its own (a 200-word
 * turn is ~200 rows) and built each n-gram's string first; that was half the job's CPU time.
 */
public final class TextHashes {
    private TextHashes() {}

    /** Offsets of the word starts, plus one past the end (as if a space followed the last word). */
    static int[] wordBounds(byte[] text) {
        int words = 1;
        for (byte b : text) {
            if (b == ' ') words++;
        }
        int[] bounds = new int[words + 1];
        int w = 1;
        for (int i = 0; i < text.length; i++) {
            if (text[i] == ' ') bounds[w++] = i + 1;
        }
        bounds[words] = text.length + 1;
        return bounds;
    }

    /** {@code ngram_xxhash64(text, n)}: xxhash64 (seed 42) of every word n-gram, in order; empty under n words. */
    public static final class NgramXxhash64 implements UDF2<byte[], Integer, long[]> {
        @Override
        public long[] call(byte[] text, Integer n) {
            if (text == null || n == null) return null;
            int[] bounds = wordBounds(text);
            int words = bounds.length - 1;
            if (words < n) return new long[0];
            long[] out = new long[words - n + 1];
            for (int i = 0; i < out.length; i++) {
                int start = bounds[i], end = bounds[i + n] - 1;
                out[i] = XXH64.hashUnsafeBytes(text, Platform.BYTE_ARRAY_OFFSET + start, end - start, 42L);
            }
            return out;
        }
    }

    /**
     * {@code minhash_signature(text, n, coefficients)}: per hash function k, the minimum over the
     * text's word n-gram shingles s of {@code (a_k * crc32(s) + b_k) mod (2^31 - 1)}; a text of fewer
     * than n words is one shingle, the whole text. {@code coefficients}: "a1:b1,a2:b2,..." (parsed
     * once per distinct value; a literal in the query).
     */
    public static final class MinhashSignature implements UDF3<byte[], Integer, String, long[]> {
        private static final long PRIME = (1L << 31) - 1;
        private transient volatile Object[] parsed; // {String spec, long[] a, long[] b}

        private Object[] coefficients(String spec) {
            Object[] p = parsed;
            if (p != null && spec.equals(p[0])) return p;
            String[] pairs = spec.split(",");
            long[] a = new long[pairs.length], b = new long[pairs.length];
            for (int k = 0; k < pairs.length; k++) {
                String[] ab = pairs[k].split(":");
                a[k] = Long.parseLong(ab[0]);
                b[k] = Long.parseLong(ab[1]);
            }
            p = new Object[] {spec, a, b};
            parsed = p;
            return p;
        }

        @Override
        public long[] call(byte[] text, Integer n, String spec) {
            if (text == null || n == null || spec == null) return null;
            Object[] p = coefficients(spec);
            long[] a = (long[]) p[1], b = (long[]) p[2];
            long[] sig = new long[a.length];
            java.util.Arrays.fill(sig, Long.MAX_VALUE);
            int[] bounds = wordBounds(text);
            int words = bounds.length - 1;
            int shingles = Math.max(1, words - n + 1);
            CRC32 crc = new CRC32();
            for (int i = 0; i < shingles; i++) {
                int start = words < n ? 0 : bounds[i];
                int end = words < n ? text.length : bounds[i + n] - 1;
                crc.reset();
                crc.update(text, start, end - start);
                long h = crc.getValue();
                for (int k = 0; k < sig.length; k++) {
                    long v = (a[k] * h + b[k]) % PRIME;
                    if (v < sig[k]) sig[k] = v;
                }
            }
            return sig;
        }
    }
}
