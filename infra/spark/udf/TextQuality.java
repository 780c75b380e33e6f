package chatpipe.spark;

import org.apache.spark.sql.api.java.UDF3;

/**
 * {@code chatpipe_text_chars(answer, prosePunct, longRun)}: how many characters (code points) of the
 * answer are text, by the rule of spark_jobs/filters.py ("mostly_non_text"): letters (any script,
 * {@link Character#isLetter}, as Java's {@code \p{L}}), ASCII digits, whitespace (space, tab, CR, LF) and
 * the characters of {@code prosePunct}; every character of a whitespace-free run of {@code longRun} or
 * more characters that holds no {@code ://} is not text.
 *
 * <p>The Spark SQL path computes the same number with two regex replacements over the answer (tested
 * equal, spark_jobs/jvm_functions.py); this is one pass over the characters.
 */
public final class TextQuality {
    private TextQuality() {}

    static boolean isSpace(int cp) {
        return cp == ' ' || cp == '\t' || cp == '\n' || cp == '\r';
    }

    /** Whether {@code text[start, end)} holds "://" (a URL is text, not a blob). */
    static boolean holdsUrlMark(String text, int start, int end) {
        for (int j = start; j + 3 <= end; j++) {
            if (text.charAt(j) == ':' && text.charAt(j + 1) == '/' && text.charAt(j + 2) == '/') return true;
        }
        return false;
    }

    public static final class TextChars implements UDF3<String, String, Integer, Integer> {
        @Override
        public Integer call(String text, String prosePunct, Integer longRun) {
            if (text == null || prosePunct == null || longRun == null) return null;
            int count = 0;
            int i = 0, len = text.length();
            while (i < len) {
                int cp = text.codePointAt(i);
                if (isSpace(cp)) {
                    count++;
                    i++;
                    continue;
                }
                int end = i, runChars = 0;
                while (end < len) {
                    int c = text.codePointAt(end);
                    if (isSpace(c)) break;
                    end += Character.charCount(c);
                    runChars++;
                }
                boolean blob = runChars >= longRun && !holdsUrlMark(text, i, end);
                if (!blob) {
                    for (int j = i; j < end; ) {
                        int c = text.codePointAt(j);
                        if (Character.isLetter(c) || (c >= '0' && c <= '9') || prosePunct.indexOf(c) >= 0) count++;
                        j += Character.charCount(c);
                    }
                }
                i = end;
            }
            return count;
        }
    }
}
