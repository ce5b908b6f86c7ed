package idemotel

import "go.opentelemetry.io/otel/attribute"

// idem's own attributes, all under the idem. prefix
// (docs/observability.md has the table).
const (
	attrSource       = attribute.Key("idem.source")        // spans, metrics
	attrKeyHash      = attribute.Key("idem.key.hash")      // spans (Config.Keys KeyHash)
	attrKey          = attribute.Key("idem.key")           // spans (Config.Keys KeyPlain)
	attrOutcome      = attribute.Key("idem.outcome")       // spans, metrics: the claim's answer
	attrAttempt      = attribute.Key("idem.attempt")       // spans
	attrBatch        = attribute.Key("idem.batch.size")    // spans: a batch claim's number of items
	attrReplayed     = attribute.Key("idem.replayed")      // spans
	attrCached       = attribute.Key("idem.cached")        // spans: the claim was answered by the cache
	attrEffect       = attribute.Key("idem.effect.name")   // spans
	attrWaitMS       = attribute.Key("idem.wait.ms")       // the idem.waited event
	attrAnswer       = attribute.Key("idem.http.answer")   // spans, metrics
	attrReason       = attribute.Key("idem.http.reason")   // idemhttp's refused and replayed events
	attrInboxOutcome = attribute.Key("idem.inbox.outcome") // spans, metrics: an attempt's outcome
)

// Semantic conventions (messaging, errors): the names of the
// OpenTelemetry specification, spelled here so that the module does not
// pin a semconv package version.
const (
	semMessagingSystem = attribute.Key("messaging.system")
	semOperationType   = attribute.Key("messaging.operation.type")
	semOperationName   = attribute.Key("messaging.operation.name")
	semDestination     = attribute.Key("messaging.destination.name")
	semMessageID       = attribute.Key("messaging.message.id")
	semErrorType       = attribute.Key("error.type")
)
