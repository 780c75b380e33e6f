package dev.chatpipe.examples;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Properties;
import java.util.TreeMap;
import java.util.UUID;
import java.util.concurrent.ExecutionException;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.generic.GenericRecordBuilder;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.avro.message.SchemaStore;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.errors.TopicExistsException;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * Send one prompt to chatpipe by producing a PromptRequest to {@code chat.prompts} and stream the answer
 * back from a reply topic (docs/producing.md). Generic records only: the schemas are parsed at run time
 * from chatpipe's {@code schemas/avro} folder, no code generation.
 *
 * <p>Avro's {@link BinaryMessageEncoder} writes the spec's single-object encoding (C3 01, the 8-byte
 * little-endian CRC-64-AVRO fingerprint of the writer schema, the body); {@link BinaryMessageDecoder}
 * finds the writer schema of each message by that fingerprint in a {@link SchemaStore} holding every
 * TokenChunk version, and resolves it to the newest one, so v1 and v2 chunks both decode.
 *
 * <p>Exit codes: 0 answered; 2 the pipeline answered with an error chunk; 3 no final chunk in time;
 * 1 bad arguments or schemas.
 */
public final class ProducePrompt {
    static final int EXIT_ERROR_CHUNK = 2;
    static final int EXIT_TIMEOUT = 3;
    static final String ATTEMPT_HEADER = "chatpipe-attempt";

    /** Every version of one record, newest last, parsed from {@code <Name>.v<N>.avsc}. */
    static List<Schema> loadVersions(Path dir, String name) throws IOException {
        Pattern file = Pattern.compile(Pattern.quote(name) + "\\.v(\\d+)\\.avsc");
        TreeMap<Integer, Schema> byVersion = new TreeMap<>();
        try (DirectoryStream<Path> files = Files.newDirectoryStream(dir, name + ".v*.avsc")) {
            for (Path path : files) {
                Matcher m = file.matcher(path.getFileName().toString());
                if (m.matches()) {
                    // one Parser per file: two versions of the same named record cannot share one
                    byVersion.put(Integer.parseInt(m.group(1)), new Schema.Parser().parse(path.toFile()));
                }
            }
        }
        if (byVersion.isEmpty()) {
            throw new IllegalArgumentException("no " + name + ".v*.avsc in " + dir + " (give --schema-dir)");
        }
        return new ArrayList<>(byVersion.values());
    }

    static Map<String, String> parseArgs(String[] argv) {
        Map<String, String> a = new TreeMap<>(Map.of(
                "--bootstrap-servers", "127.0.0.1:9092", "--topic-prefix", "", "--reply-partition", "0",
                "--role", "user", "--user-id", "example-user", "--tenant", "example-tenant",
                "--model", "smollm2-135m-instruct", "--max-tokens", "64", "--timeout-s", "120",
                "--schema-dir", "../../schemas/avro"));
        a.put("--priority", "INTERACTIVE");
        for (int i = 0; i < argv.length; i++) {
            String flag = argv[i];
            if (!flag.startsWith("--") || i + 1 >= argv.length) {
                throw new IllegalArgumentException("expected --flag value pairs, got " + flag);
            }
            a.put(flag, argv[++i]);
        }
        if (!a.containsKey("--prompt")) {
            throw new IllegalArgumentException("--prompt is required");
        }
        return a;
    }

    public static void main(String[] argv) throws Exception {
        System.setProperty("org.slf4j.simpleLogger.defaultLogLevel", "warn");
        Map<String, String> a;
        List<Schema> promptVersions;
        List<Schema> chunkVersions;
        try {
            a = parseArgs(argv);
            Path schemaDir = Path.of(a.get("--schema-dir"));
            promptVersions = loadVersions(schemaDir, "PromptRequest");
            chunkVersions = loadVersions(schemaDir, "TokenChunk");
        } catch (IllegalArgumentException | IOException e) {
            System.err.println("error: " + e.getMessage());
            System.exit(1);
            return;
        }
        System.exit(run(a, promptVersions, chunkVersions));
    }

    static int run(Map<String, String> a, List<Schema> promptVersions, List<Schema> chunkVersions) throws Exception {
        String bootstrap = a.get("--bootstrap-servers");
        String prefix = a.get("--topic-prefix");
        double timeoutS = Double.parseDouble(a.get("--timeout-s"));
        int replyPartition = Integer.parseInt(a.get("--reply-partition"));
        String conversationId = a.getOrDefault("--conversation-id", UUID.randomUUID().toString().replace("-", ""));
        String replyTopic = a.get("--reply-topic");
        if (replyTopic == null) {
            replyTopic = prefix + "replies." + UUID.randomUUID().toString().replace("-", "").substring(0, 12);
            createReplyTopic(bootstrap, replyTopic);
        }

        Schema promptSchema = promptVersions.get(promptVersions.size() - 1);
        BinaryMessageEncoder<GenericRecord> encoder = new BinaryMessageEncoder<>(GenericData.get(), promptSchema);
        Schema chunkSchema = chunkVersions.get(chunkVersions.size() - 1);
        SchemaStore.Cache writers = new SchemaStore.Cache();
        chunkVersions.forEach(writers::addSchema);
        BinaryMessageDecoder<GenericRecord> decoder =
                new BinaryMessageDecoder<>(GenericData.get(), chunkSchema, writers);
        // What the encoder writes after C3 01, as a number (on the wire: its 8 bytes little-endian).
        System.err.printf("PromptRequest writer schema fingerprint %016x%n",
                SchemaNormalization.parsingFingerprint64(promptSchema));

        GenericRecord request = promptRequest(a, promptSchema, conversationId, replyTopic, replyPartition);
        String requestId = request.get("request_id").toString();
        try (KafkaConsumer<String, byte[]> consumer = replyConsumer(bootstrap);
             KafkaProducer<String, byte[]> producer = producer(bootstrap)) {
            // Place the reader at the partition's current end BEFORE producing, so no chunk is missed.
            TopicPartition tp = new TopicPartition(replyTopic, replyPartition);
            consumer.assign(List.of(tp));
            consumer.seek(tp, consumer.endOffsets(List.of(tp)).get(tp));
            byte[] value = encoder.encode(request).array();
            producer.send(new ProducerRecord<>(prefix + "chat.prompts", conversationId, value)).get();
            System.err.printf("request %s conversation %s -> reply %s[%d]%n", requestId, conversationId,
                    replyTopic, replyPartition);
            GenericRecord last = streamAnswer(consumer, decoder, requestId, timeoutS);
            System.out.println();
            if (last == null) {
                System.err.printf("error: no final chunk within %.0f s%n", timeoutS);
                return EXIT_TIMEOUT;
            }
            if (last.get("error_code") != null) {
                System.err.printf("error: %s: %s%n", last.get("error_code"), last.get("error"));
                return EXIT_ERROR_CHUNK;
            }
            System.out.printf("usage: prompt_tokens=%s completion_tokens=%s finish_reason=%s%n",
                    last.get("tokens_in"), last.get("tokens_out"), last.get("finish_reason"));
            return 0;
        }
    }

    static GenericRecord promptRequest(Map<String, String> a, Schema schema, String conversationId,
                                       String replyTopic, int replyPartition) {
        Schema messageSchema = schema.getField("messages").schema().getElementType();
        List<GenericRecord> messages = new ArrayList<>();
        if (a.containsKey("--system")) {
            messages.add(new GenericRecordBuilder(messageSchema)
                    .set("role", "system").set("content", a.get("--system")).build());
        }
        messages.add(new GenericRecordBuilder(messageSchema).set("role", a.get("--role"))
                .set("content", a.get("--prompt")).build());
        Schema samplingSchema = schema.getField("sampling").schema();
        GenericRecord sampling = new GenericRecordBuilder(samplingSchema)  // unset fields take their defaults
                .set("max_tokens", Integer.parseInt(a.get("--max-tokens")))
                .set("temperature", 0.0)
                .build();
        Schema prioritySchema = schema.getField("priority").schema();
        return new GenericRecordBuilder(schema)
                .set("request_id", UUID.randomUUID().toString().replace("-", ""))
                .set("conversation_id", conversationId)
                .set("user_id", a.get("--user-id"))
                .set("tenant", a.get("--tenant"))
                .set("created_at", System.currentTimeMillis())  // timestamp-millis: epoch ms as a long
                .set("model", a.get("--model"))
                .set("messages", messages)
                .set("sampling", sampling)
                .set("reply_to", replyTopic)  // the full topic name: no prefix is added to it
                .set("reply_partition", replyPartition)
                .set("priority", new GenericData.EnumSymbol(prioritySchema, a.get("--priority")))
                .set("schema_version", 2)
                .build();
    }

    /** Prints the text of requestId's chunks as they come; returns the final chunk, or null on timeout. */
    static GenericRecord streamAnswer(KafkaConsumer<String, byte[]> consumer,
                                      BinaryMessageDecoder<GenericRecord> decoder,
                                      String requestId, double timeoutS) throws IOException {
        long deadline = System.nanoTime() + (long) (timeoutS * 1e9);
        String attempt = null;
        int nextIndex = 0;
        while (System.nanoTime() < deadline) {
            for (ConsumerRecord<String, byte[]> rec : consumer.poll(Duration.ofMillis(200))) {
                GenericRecord chunk = decoder.decode(rec.value());
                if (!requestId.equals(chunk.get("request_id").toString())) {
                    continue;  // another request's answer on a shared reply topic
                }
                Header h = rec.headers().lastHeader(ATTEMPT_HEADER);
                String thisAttempt = h == null ? null : new String(h.value(), StandardCharsets.US_ASCII);
                int index = (Integer) chunk.get("index");
                if (!Objects.equals(thisAttempt, attempt)) {
                    if (index != 0) {
                        continue;  // the rest of an abandoned serving attempt
                    }
                    if (nextIndex > 0) {
                        System.err.println("\n[the request was served again; the answer restarts]");
                    }
                    attempt = thisAttempt;
                    nextIndex = 0;
                }
                if (index != nextIndex) {
                    continue;  // a duplicate chunk
                }
                nextIndex++;
                System.out.print(chunk.get("text"));
                System.out.flush();
                if ((Boolean) chunk.get("is_final")) {
                    return chunk;
                }
            }
        }
        return null;
    }

    static void createReplyTopic(String bootstrap, String topic) throws Exception {
        Properties p = new Properties();
        p.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        try (Admin admin = Admin.create(p)) {
            NewTopic t = new NewTopic(topic, 1, (short) 1).configs(Map.of("retention.ms", "3600000"));
            admin.createTopics(List.of(t)).all().get();
        } catch (ExecutionException e) {
            if (!(e.getCause() instanceof TopicExistsException)) {
                throw e;
            }
        }
    }

    static KafkaConsumer<String, byte[]> replyConsumer(String bootstrap) {
        Properties p = new Properties();
        p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        p.put(ConsumerConfig.FETCH_MAX_WAIT_MS_CONFIG, "20");
        return new KafkaConsumer<>(p, new StringDeserializer(), new ByteArrayDeserializer());
    }

    static KafkaProducer<String, byte[]> producer(String bootstrap) {
        Properties p = new Properties();
        p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        // No partitioner.class: the default (murmur2 of the key, the conversation id) is chatpipe's rule,
        // the partition its gateway and streams tier use (docs/producing.md "Keys and partitions").
        return new KafkaProducer<>(p, new StringSerializer(), new ByteArraySerializer());
    }
}
