// The senders' own Node libraries, one request per line on stdin, one
// answer per line on stdout: {"ok":bool,"value":string,"error":string}.
// Used by TestSignedByNodeLibraries (sendersigned_node_test.go).
import readline from "node:readline";
import adyen from "@adyen/api-library";
import twilio from "twilio";
import { WebhooksHelper } from "square";
import { Signature } from "@hubspot/api-client/lib/src/utils/signature.js";
import { Paddle } from "@paddle/paddle-node-sdk";
import { LinearWebhookClient } from "@linear/sdk/webhooks";

// Paddle's verifier needs the runtime a client sets up; the API key is a
// placeholder in Paddle's format and is never used to call Paddle.
const paddle = new Paddle("pdl_sdbx_apikey_01gtgztp8f4xdgxhqtd8kp1xyz_abcdefghijklmnopqrstuv_abc");

const ops = {
  // Twilio signs: the expected X-Twilio-Signature of url and form params.
  "twilio.sign": (q) => twilio.getExpectedTwilioSignature(q.key, q.url, q.params || {}),
  "twilio.verify": (q) => q.json
    ? twilio.validateRequestWithBody(q.key, q.headers["x-twilio-signature"], q.url, q.body)
    : twilio.validateRequest(q.key, q.headers["x-twilio-signature"], q.url, q.params || {}),
  // HubSpot signs: X-HubSpot-Signature-v3.
  "hubspot.sign": (q) => Signature.getSignature("POST", "v3", { clientSecret: q.key, url: q.url, requestBody: q.body, timestamp: Number(q.timestamp) }),
  "hubspot.verify": (q) => Signature.isValid({ method: "POST", signatureVersion: "v3", signature: q.headers["x-hubspot-signature-v3"],
    clientSecret: q.key, url: q.url, requestBody: q.body, timestamp: Number(q.headers["x-hubspot-request-timestamp"]) }),
  // Adyen signs: every NotificationRequestItem's hmacSignature, the body
  // returned as the library's JSON.stringify writes it.
  "adyen.sign": (q) => {
    const n = JSON.parse(q.body);
    const v = new adyen.hmacValidator();
    for (const w of n.notificationItems) {
      const item = w.NotificationRequestItem;
      item.additionalData = item.additionalData || {};
      item.additionalData.hmacSignature = v.calculateHmac(item, q.key);
    }
    return JSON.stringify(n);
  },
  "adyen.verify": (q) => {
    const v = new adyen.hmacValidator();
    return JSON.parse(q.body).notificationItems.every((w) => v.validateHMAC(w.NotificationRequestItem, q.key));
  },
  "square.verify": (q) => WebhooksHelper.verifySignature({ requestBody: q.body, signatureHeader: q.headers["x-square-hmacsha256-signature"],
    signatureKey: q.key, notificationUrl: q.url }),
  "paddle.verify": (q) => paddle.webhooks.isSignatureValid(q.body, q.key, q.headers["paddle-signature"]),
  "linear.verify": (q) => new LinearWebhookClient(q.key).verify(Buffer.from(q.body), q.headers["linear-signature"]),
};

const rl = readline.createInterface({ input: process.stdin });
for await (const line of rl) {
  let out;
  try {
    const q = JSON.parse(line);
    const v = await ops[q.op](q);
    out = typeof v === "boolean" ? { ok: v } : { ok: true, value: String(v) };
  } catch (e) {
    out = { ok: false, error: String(e && e.message || e) };
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}
