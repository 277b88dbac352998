// Sends GenAI-shaped spans to an OTLP/HTTP endpoint through the real
// OpenTelemetry JS exporter (OTLP/JSON, as Next.js and Vercel apps send it).
// Usage: node send_spans.mjs <http endpoint, e.g. http://127.0.0.1:4318/v1/traces> <turns>
// Prints one JSON line: {"trace_ids": [...], "span_ids": [...]}.
import { context, trace } from "@opentelemetry/api";
import { OTLPTraceExporter } from "@opentelemetry/exporter-trace-otlp-http";
import { resourceFromAttributes } from "@opentelemetry/resources";
import { BasicTracerProvider, BatchSpanProcessor } from "@opentelemetry/sdk-trace-base";

const [url, turnsArg] = process.argv.slice(2);
const turns = Number(turnsArg || "3");
const exporter = new OTLPTraceExporter({ url });
const provider = new BasicTracerProvider({
  resource: resourceFromAttributes({ "service.name": "js-exporter-test" }),
  spanProcessors: [new BatchSpanProcessor(exporter)],
});
const tracer = provider.getTracer("tracejudge-test");
const traceIds = [];
const spanIds = [];
for (let i = 0; i < turns; i++) {
  const root = tracer.startSpan("invoke_agent ShopBot", {
    attributes: { "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "js-conv-1" },
  });
  const ctx = trace.setSpan(context.active(), root);
  const chat = tracer.startSpan("chat gpt-4o-mini", {
    attributes: {
      "gen_ai.operation.name": "chat",
      "gen_ai.request.model": "gpt-4o-mini",
      "gen_ai.input.messages": JSON.stringify([{ role: "user", parts: [{ type: "text", content: `turno ${i}: dov'è il mio ordine? 📦` }] }]),
      "gen_ai.usage.input_tokens": 12 + i,
    },
  }, ctx);
  chat.end();
  root.end();
  traceIds.push(root.spanContext().traceId);
  spanIds.push(root.spanContext().spanId, chat.spanContext().spanId);
}
await provider.forceFlush();
await provider.shutdown();
console.log(JSON.stringify({ trace_ids: traceIds, span_ids: spanIds }));
