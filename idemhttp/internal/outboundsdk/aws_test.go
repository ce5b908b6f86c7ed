package outboundsdk_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	"github.com/aws/aws-sdk-go-v2/service/ecs"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// ecsAPI is a stand-in for ECS's RunTask (awsJson1_1), which dedupes by the
// clientToken in the request's body, as ECS does: every task started is a
// charge.
func ecsAPI(loseAny int) *api {
	return &api{loseAny: loseAny,
		key: func(_ *http.Request, body []byte) string {
			var in struct {
				ClientToken string `json:"clientToken"`
			}
			_ = json.Unmarshal(body, &in)
			return in.ClientToken
		},
		answer: func(w http.ResponseWriter, id, _ string) {
			w.Header().Set("Content-Type", "application/x-amz-json-1.1")
			json.NewEncoder(w).Encode(map[string]any{
				"tasks": []any{map[string]any{"taskArn": "arn:aws:ecs:us-east-1:123456789012:task/default/" + id}}, "failures": []any{},
			})
		}}
}

// ecsClient is aws-sdk-go-v2's ECS client over rt: its standard retryer
// (2 attempts here, no backoff) retries a lost answer with the same
// request, clientToken included. The token is filled in, when the call
// gives none, with a random UUID once per call, before the retry loop
// (the OperationIdempotencyTokenAutoFill middleware).
func ecsClient(url string, rt http.RoundTripper) *ecs.Client {
	return ecs.New(ecs.Options{
		Region: "us-east-1", BaseEndpoint: aws.String(url), HTTPClient: &http.Client{Transport: rt},
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "AKIDTEST", SecretAccessKey: "secret"}, nil
		}),
		Retryer: retry.NewStandard(func(o *retry.StandardOptions) {
			o.MaxAttempts = 2
			o.Backoff = retry.BackoffDelayerFunc(func(int, error) (time.Duration, error) { return 0, nil })
		}),
	})
}

// TestOutboundAWSClientToken: aws-sdk-go-v2's idempotent APIs take their
// key in the body (ECS RunTask's clientToken), which a header-based
// Transport cannot set, and fill it with a random UUID per call when the
// caller gives none: the SDK's own retries send the same token, but the
// effect's next attempt sends another. Both attempts of the first call
// lose their answer; the event's next delivery runs the effect again:
// with the SDK's token, two tasks started; with the effect's OutboundKey
// as the ClientToken, one, every request under the one token. Outside an
// effect the write is refused, with its random token.
func TestOutboundAWSClientToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	runTask := func(ec *ecs.Client, job string, outboundKey bool) (errs []error) {
		for range 3 { // the event's deliveries
			_, err := c.Do(ctx, "jobs", job, func(ctx context.Context) (any, error) {
				return idem.EffectValue(ctx, c, "run_task", func(ctx context.Context) (string, error) {
					in := &ecs.RunTaskInput{TaskDefinition: aws.String("report:3"), Cluster: aws.String("default")}
					if outboundKey {
						eff, _ := idem.EffectFrom(ctx)
						in.ClientToken = aws.String(eff.OutboundKey("ecs RunTask")) // 64 characters: ECS takes up to 64
					}
					out, err := ec.RunTask(ctx, in)
					if err != nil {
						return "", err
					}
					return *out.Tasks[0].TaskArn, nil
				})
			})
			errs = append(errs, err)
		}
		return errs
	}
	t.Run("the SDK's own token", func(t *testing.T) {
		a := ecsAPI(2)
		errs := runTask(ecsClient(serve(t, a).URL, rt), "job-1", false)
		n, keys := a.counts()
		if n != 2 || len(keys) != 3 || keys[0] != keys[1] || keys[2] == keys[0] || errs[0] == nil || errs[1] != nil {
			t.Fatalf("%d tasks started, tokens %q, deliveries %v; want 2 (one token per call, the SDK's retry under the same)", n, keys, errs)
		}
	})
	t.Run("OutboundKey as the ClientToken", func(t *testing.T) {
		a := ecsAPI(2)
		var mu sync.Mutex
		var headers []string // per request: whether it carried the Transport's header, and whether it was signed
		srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			headers = append(headers, fmt.Sprintf("key %v signed %v", r.Header.Get("Idempotency-Key") != "",
				strings.Contains(strings.ToLower(r.Header.Get("Authorization")), "idempotency-key")))
			mu.Unlock()
			a.ServeHTTP(w, r)
		}))
		errs := runTask(ecsClient(srv.URL, rt), "job-2", true)
		want := idem.Effect{Name: "run_task", EventSource: "jobs", EventKey: "job-2"}.OutboundKey("ecs RunTask")
		n, keys := a.counts()
		if n != 1 || fmt.Sprint(keys) != fmt.Sprint([]string{want, want, want}) || errs[0] == nil || errs[1] != nil || errs[2] != nil {
			t.Fatalf("%d tasks started, tokens %q, deliveries %v; want 1, the effect's token 3 times", n, keys, errs)
		}
		mu.Lock()
		defer mu.Unlock()
		for _, h := range headers {
			if h != "key true signed false" {
				t.Fatalf("requests: %q; want the Transport's header on each, outside SigV4's signed headers", headers)
			}
		}
	})
	t.Run("outside an effect", func(t *testing.T) {
		a := ecsAPI(0)
		_, err := ecsClient(serve(t, a).URL, rt).RunTask(ctx, &ecs.RunTaskInput{TaskDefinition: aws.String("report:3")})
		if n, _ := a.counts(); n != 0 || !errors.Is(err, idemhttp.ErrNoEffect) {
			t.Fatalf("%d tasks started, error %v; want none, ErrNoEffect", n, err)
		}
	})
}
