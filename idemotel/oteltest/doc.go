// Package oteltest holds idemotel's acceptance tests, in a module of their
// own so that the modules they need (the OpenTelemetry SDK, otelhttp,
// otelpgx, idemhttp, the inbox and River) stay out of idemotel's go.mod:
// a program that imports idemotel requires only the OpenTelemetry API.
package oteltest
